"""Train a data x tensor parallel MLP on scikit-learn's handwritten digits, and check it is exact.

The model is one Megatron-style MLP block (Shoeybi et al. 2019, "Megatron-LM", §3, Fig. 3a):
the first linear layer is column-parallel (each tensor-parallel device holds H/tensor columns of
w1, so ReLU is applied to its own slice with no communication), the second is row-parallel (each
device holds the matching H/tensor rows of w2 and produces a partial sum of the logits, which one
``fpar.psum`` over ``"tensor"`` completes). The batch is split over ``"data"`` and the loss is
averaged with ``fpar.pmean`` over ``"data"``.

The mesh fits the devices it is given (``--devices N`` in-process, default 8; under torchrun the
world size, one process per device): data=2 once there are 4 devices or more, tensor the rest,
so 8 devices are data=2 x tensor=4, 4 are 2 x 2, and 2 are tensor=2 alone.

Gradients come from ``torch.func.grad_and_value`` of the *sharded* loss; fpar makes them the
gradients of the global loss, so the data-parallel all-reduce of gradients needs no code here.
The optimizer is SGD with momentum written as two ``tree_map`` calls over the parameter dict.

At the end the same training is run unsharded (same init, same batches, the same model as a
plain torch function) and the two loss curves must agree to float tolerance; the script exits
non-zero if they do not.

Run:
    python examples/mlp_digits.py            # 20 epochs, ~97% test accuracy, ~20 s on 2 cores
    python examples/mlp_digits.py --quick    # 3 epochs, a smoke test
    python examples/mlp_digits.py --dtype float64
    torchrun --nproc-per-node 4 examples/mlp_digits.py --quick   # a real mesh, data=2 x tensor=2

Shape suffixes (torchtitan style). Outside the sharded function a suffix is a global shape;
inside it, the same letters name the per-device block, whose size is given in the comment:
    N  images in a split (1500 train, 297 test)
    B  batch: BATCH global, BATCH / data per device (split over "data")
    D  input features: 64 (8 x 8 pixels), never split
    H  hidden units: HIDDEN global, HIDDEN / tensor per device (split over "tensor")
    C  classes: 10, never split
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import optree
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _common.py, next to this file
import _common as C  # noqa: E402

import fpar  # noqa: E402
from fpar import P  # noqa: E402

HIDDEN = 256  # divisible by the tensor axis
BATCH = 100  # divisible by the data axis (1 or 2); 1500 / 100 = 15 steps per epoch
N_TEST = 297  # 297 of the 1797 images, drawn by a fixed shuffle; 1500 train
LR, MOMENTUM = 0.05, 0.9

# ---------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------


def load_data(dtype: torch.dtype):
    """Return standardised (x_ND, y_N) for train and test; statistics come from train only."""
    digits = load_digits()
    # A fixed shuffle before splitting: the file is not in random order, and its last 297 images
    # are harder for this model (~91% test accuracy when held out, ~97% for a shuffled split).
    perm_N = torch.randperm(len(digits.target), generator=torch.Generator().manual_seed(0))
    x_ND = torch.tensor(digits.data, dtype=torch.float64)[perm_N]
    y_N = torch.tensor(digits.target, dtype=torch.int64)[perm_N]
    x_train_ND, x_test_ND = x_ND[:-N_TEST], x_ND[-N_TEST:]
    mean_D = x_train_ND.mean(0)
    std_D = x_train_ND.std(0)
    std_D[std_D == 0] = 1.0  # some border pixels are always 0
    x_train_ND = ((x_train_ND - mean_D) / std_D).to(dtype)
    x_test_ND = ((x_test_ND - mean_D) / std_D).to(dtype)
    return (x_train_ND, y_N[:-N_TEST]), (x_test_ND, y_N[-N_TEST:])


def batches(n: int, epoch: int):
    """Yield index tensors of size BATCH: a fixed permutation per epoch (same for both runs)."""
    gen = torch.Generator().manual_seed(1000 + epoch)
    perm = torch.randperm(n, generator=gen)
    for start in range(0, n - BATCH + 1, BATCH):
        yield perm[start : start + BATCH]


# ---------------------------------------------------------------------------------------------
# Model: parameters, and the loss written twice (per-device with collectives, and plain)
# ---------------------------------------------------------------------------------------------


def init_params(d: int, h: int, c: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Return global parameters (LeCun-normal weights, zero biases) from a fixed seed."""
    gen = torch.Generator().manual_seed(0)
    return {
        "w1": (torch.randn(d, h, generator=gen, dtype=torch.float64) / d**0.5).to(dtype),  # DH
        "b1": torch.zeros(h, dtype=dtype),  # H
        "w2": (torch.randn(h, c, generator=gen, dtype=torch.float64) / h**0.5).to(dtype),  # HC
        "b2": torch.zeros(c, dtype=dtype),  # C
    }


# How each parameter is laid out over the mesh (Megatron 1D tensor parallelism).
PARAM_SPECS = {
    "w1": P(None, "tensor"),  # column-parallel: each device holds D x H/4
    "b1": P("tensor"),  # matches w1's columns: H/4
    "w2": P("tensor", None),  # row-parallel: each device holds H/4 x C
    "b2": P(),  # replicated: added once, after the psum
}


def logits_local(params, x_BD):
    """Per-device forward: local blocks in, logits replicated over "tensor" out."""
    w1_DH, b1_H, w2_HC, b2_C = params["w1"], params["b1"], params["w2"], params["b2"]
    h_BH = torch.relu(x_BD @ w1_DH + b1_H)  # (B/data, H/tensor): column-parallel, no collective
    partial_BC = h_BH @ w2_HC  # (B/data, C): this device's share of the sum over H
    return fpar.psum(partial_BC, "tensor") + b2_C  # (B/data, C): row-parallel all-reduce


def loss_local(params, x_BD, y_B):
    """Per-device loss: cross-entropy of the local batch, averaged over "data"."""
    # Equal local batches, so the mean of local means is the global mean.
    return fpar.pmean(F.cross_entropy(logits_local(params, x_BD), y_B), "data")


def logits_unsharded(params, x_BD):
    """The same model as a plain torch function on global tensors."""
    h_BH = torch.relu(x_BD @ params["w1"] + params["b1"])  # (B, H)
    return h_BH @ params["w2"] + params["b2"]  # (B, C)


def loss_unsharded(params, x_BD, y_B):
    """The global loss the sharded one must equal."""
    return F.cross_entropy(logits_unsharded(params, x_BD), y_B)


# ---------------------------------------------------------------------------------------------
# Training: a pure step function, SGD with momentum over the parameter pytree
# ---------------------------------------------------------------------------------------------


def sgd_momentum(params, velocity, grads):
    """Return updated (params, velocity): v <- mu v + g, p <- p - lr v (PyTorch's SGD rule)."""
    velocity = optree.tree_map(lambda v, g: MOMENTUM * v + g, velocity, grads)
    params = optree.tree_map(lambda p, v: p - LR * v, params, velocity)
    return params, velocity


def make_step(loss_fn):
    """Return step(params, velocity, x, y) -> (params, velocity, loss) for a loss function."""
    grad_and_loss = torch.func.grad_and_value(loss_fn)  # differentiates argument 0: params

    def step(params, velocity, x_BD, y_B):
        grads, loss = grad_and_loss(params, x_BD, y_B)
        params, velocity = sgd_momentum(params, velocity, grads)
        return params, velocity, loss

    return step


def accuracy(logits_fn, params, x_ND, y_N) -> float:
    """Return the fraction of images whose arg-max logit is the label."""
    with torch.no_grad():
        return (logits_fn(params, x_ND).argmax(-1) == y_N).double().mean().item()


def train(step, logits_fn, params, train_data, test_data, epochs: int, *, label: str, log=True, log_every=0):
    """Run `epochs` epochs; return the final params, the per-step losses and per-epoch test accuracy.

    Printed per epoch (when `log`): the mean training loss over the epoch's steps, and the test
    accuracy after the epoch, computed with `logits_fn`; and every `log_every` steps (if not 0)
    the step's loss.
    """
    (x_train_ND, y_train_N), (x_test_ND, y_test_N) = train_data, test_data
    velocity = optree.tree_map(torch.zeros_like, params)
    losses, accs = [], []
    total = epochs * (len(y_train_N) // BATCH)
    t0 = time.perf_counter()
    for epoch in range(epochs):
        epoch_losses = []
        for idx_B in batches(len(y_train_N), epoch):
            params, velocity, loss = step(params, velocity, x_train_ND[idx_B], y_train_N[idx_B])
            epoch_losses.append(loss.detach())
            n = len(losses) + len(epoch_losses)
            if log and log_every and n % log_every == 0:
                C.say(f"step {n:4d}/{total} | loss {loss.item():.4f}")
        losses += epoch_losses
        accs.append(accuracy(logits_fn, params, x_test_ND, y_test_N))
        if log:
            mean_loss = torch.stack(epoch_losses).mean().item()
            C.say(f"[{label}] epoch {epoch + 1:3d}  train loss {mean_loss:.4f}  test acc {accs[-1]:.4f}")
    C.say(f"[{label}] {epochs} epochs in {time.perf_counter() - t0:.2f} s")
    return params, torch.stack(losses), accs


# ---------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------


def layout(devices: int) -> tuple[int, int]:
    """(data, tensor) for ``devices``: data=2 from 4 devices on (BATCH splits in 2), tensor the rest."""
    data = 2 if devices >= 4 and devices % 2 == 0 else 1
    if HIDDEN % (devices // data):
        raise SystemExit(f"mlp_digits.py splits {HIDDEN} hidden units over tensor={devices // data}: no fit")
    return data, devices // data


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--quick", action="store_true", help="3 epochs (smoke test)")
    parser.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    parser.add_argument("--devices", type=int, default=8, help="in-process devices (torchrun: world size)")
    parser.add_argument("--log-every", type=int, default=0, help="print the loss every N steps (0: never)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (0: torch's default)")
    args = parser.parse_args(argv)
    epochs = 3 if args.quick else args.epochs
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    C.start(args.threads)  # under torchrun: join the process group (a real mesh)

    train_data, test_data = load_data(dtype)
    params0 = init_params(64, HIDDEN, 10, dtype)

    real = torch.distributed.is_initialized()
    devices = torch.distributed.get_world_size() if real else args.devices
    mesh = fpar.make_mesh(layout(devices), ("data", "tensor"))
    kind = "real: one process per device" if mesh.backend == "dist" else "in-process"
    C.say(
        f"mesh {dict(mesh.shape)} ({kind}); {len(train_data[1])} train / {len(test_data[1])} test "
        f"images; batch {BATCH}; hidden {HIDDEN}; {args.dtype}"
    )
    C.say("train loss: mean over the epoch's steps; test acc: sharded forward (test set replicated)")

    rows = P("data")
    sharded_loss = fpar.shard(loss_local, mesh, in_specs=(PARAM_SPECS, rows, rows), out_specs=P())
    # Test-set logits, also sharded. 297 images do not split over data=2, so the test batch is
    # replicated (P()): every data replica computes the same logits, and out_specs=P() is a
    # promise that check_rep verifies (the psum over "tensor" made them replicated).
    sharded_logits = fpar.shard(logits_local, mesh, in_specs=(PARAM_SPECS, P()), out_specs=P())
    sharded_step = make_step(sharded_loss)

    def step(params, velocity, x_BD, y_B):  # each process passes its own rows (in-process: all of them)
        return sharded_step(params, velocity, *fpar.device_put((x_BD, y_B), mesh, rows))

    params, losses, accs = train(
        step,
        sharded_logits,
        fpar.device_put(params0, mesh, PARAM_SPECS),  # this process's blocks
        train_data,
        test_data,
        epochs,
        label="sharded",
        log_every=args.log_every,
    )
    x_test_ND, y_test_N = test_data
    with torch.no_grad():
        test_loss = F.cross_entropy(sharded_logits(params, x_test_ND), y_test_N).item()
    C.say(f"held-out loss {test_loss:.4f}, accuracy {100 * accs[-1]:.2f}% ({len(y_test_N)} test images)")
    params = fpar.gather(params, mesh, PARAM_SPECS)  # whole, for the comparison below

    # The same training, unsharded: the contract says the curves must match.
    ref_params, ref_losses, ref_accs = train(
        make_step(loss_unsharded),
        logits_unsharded,
        params0,
        train_data,
        test_data,
        epochs,
        label="unsharded",
        log=False,
    )
    # float32 sums in a different order on the mesh (partial sums, then psum), so the curves
    # agree to rounding, not bit for bit; in float64 they agree to ~1e-15.
    rtol, atol = (1e-4, 1e-5) if dtype == torch.float32 else (1e-10, 1e-12)
    loss_diff = (losses - ref_losses).abs().max().item()
    param_rel = {k: ((params[k] - ref_params[k]).norm() / ref_params[k].norm()).item() for k in params}
    C.say(
        f"parity over {len(losses)} steps: max |loss diff| {loss_diff:.3e}; "
        f"max relative param diff (norm) {max(param_rel.values()):.3e}; "
        f"final test acc sharded {accs[-1]:.4f}, unsharded {ref_accs[-1]:.4f}"
    )
    if not torch.allclose(losses, ref_losses, rtol=rtol, atol=atol):
        raise SystemExit(
            f"FAIL: sharded and unsharded loss curves differ by up to {loss_diff:.3e} "
            f"(rtol={rtol}, atol={atol})"
        )
    if max(param_rel.values()) > rtol:
        raise SystemExit(f"FAIL: final parameters differ, relative diffs {param_rel} > {rtol}")
    C.say(f"OK: sharded training == unsharded training (rtol={rtol}, atol={atol})")


if __name__ == "__main__":
    C.entry(main)
