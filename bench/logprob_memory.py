"""Peak memory and time of the chunked log-prob engine vs. the naive full-logits path.

Both paths compute, for N = T tokens (batch 1) with hidden size H and vocab V,
log pi(target), the entropy and the top-k log-probs from ``hidden [N, H]`` and
``W [V, H]``, then run backward of a fixed random linear combination of them
to ``hidden`` and ``W`` (fp32 throughout):

* naive:   ``logits = hidden @ W.T`` ([N, V]), ``log_softmax``, gather, entropy, top-k;
* chunked: ``tether.logprobs.token_stats(..., chunk_size=C)``.

How memory is measured: every (path, T, V) case runs in a fresh Python
subprocess. After the inputs exist, the child records its current resident set
size (VmRSS) and resets the kernel's peak-RSS counter (``echo 5 >
/proc/self/clear_refs``); after forward + backward it reads the peak (VmHWM).
The reported figure is peak - baseline: all memory the case touched beyond its
inputs, including the outputs and the [V, H] weight gradient (the same for
both paths), as the OS sees it (allocator slack included, no double counting
of views). Where ``clear_refs`` cannot be written, the child falls back to
``ru_maxrss`` after the run minus VmRSS before it (an upper bound, since the
import-time peak may be included). Values and gradients are saved by each
child and compared in the parent.

Usage::

    python bench/logprob_memory.py            # T in {256, 1024, 4096}, V in {49152, 151936}
    python bench/logprob_memory.py --quick    # T in {256, 1024}, V = 49152, no fp64 reference (< 1 minute)
    python bench/logprob_memory.py --chunk-size 512 --out bench/results.md
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()
SRC = HERE.parent.parent / "src"


# --------------------------------------------------------------------------- #
# Child process: one case
# --------------------------------------------------------------------------- #


def _make_inputs(n_tok: int, vocab: int, hidden_size: int, topk: int, seed: int, logit_std: float):
    import torch

    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n_tok, hidden_size, generator=g)  # [N, H]
    # Logits have std ~logit_std over the vocabulary (3: peaked, LM-like distributions).
    weight = torch.randn(vocab, hidden_size, generator=g) * (logit_std / hidden_size**0.5)  # [V, H]
    targets = torch.randint(0, vocab, (n_tok,), generator=g)  # [N]
    c_logp = torch.randn(n_tok, generator=g)  # [N]
    c_ent = torch.randn(n_tok, generator=g)  # [N]
    c_topk = torch.randn(n_tok, topk, generator=g)  # [N, k]
    return hidden, weight, targets, c_logp, c_ent, c_topk


def _naive(hidden, weight, targets, topk):
    import torch

    logits = hidden @ weight.T  # [N, V]
    logq = torch.log_softmax(logits, dim=-1)  # [N, V]
    logp = logq.gather(-1, targets[:, None]).squeeze(-1)  # [N]
    ent = -(logq.exp() * logq).sum(-1)  # [N]
    topk_logp, topk_ids = logq.topk(topk, dim=-1)  # [N, k]
    return logp, ent, topk_logp, topk_ids


def _chunked(hidden, weight, targets, topk, chunk_size):
    from tether.logprobs import token_stats

    st = token_stats(hidden, weight, targets, topk=topk, chunk_size=chunk_size)
    return st.logp, st.entropy, st.topk_logp, st.topk_ids


def _reference(hidden, weight, targets, topk_ids, chunk_size):
    """float64 statistics with the top-k term taken at the fp32 run's top-k ids.

    Top-k selection is discontinuous: where the k-th and (k+1)-th logits are
    within fp32 rounding, fp64 may pick the other id and the top-k gradient
    jumps by O(1). Gathering at the fp32 ids makes the reference the same
    function as the one the fp32 paths differentiate.
    """
    from tether.logprobs import token_stats

    st = token_stats(hidden, weight, targets, gather_ids=topk_ids, chunk_size=chunk_size)
    return st.logp, st.entropy, st.ids_logp, topk_ids


def run_child(args: argparse.Namespace) -> None:
    sys.path.insert(0, str(SRC))
    import torch

    import tether.logprobs  # noqa: F401  (import cost outside the measurement)
    from _memory import peak_rss_bytes, reset_peak_rss, rss_bytes

    hidden, weight, targets, c_logp, c_ent, c_topk = _make_inputs(
        args.T, args.V, args.hidden, args.topk, args.seed, args.logit_std
    )
    if args.path == "ref64":  # float64 reference for the error columns (not timed against)
        hidden, weight, c_logp, c_ent, c_topk = (x.double() for x in (hidden, weight, c_logp, c_ent, c_topk))
    hidden.requires_grad_()
    weight.requires_grad_()

    base_kb = rss_bytes() // 1024
    exact = reset_peak_rss()
    t0 = time.perf_counter()
    if args.path == "naive":
        logp, ent, topk_logp, topk_ids = _naive(hidden, weight, targets, args.topk)
    elif args.path == "chunked":
        logp, ent, topk_logp, topk_ids = _chunked(hidden, weight, targets, args.topk, args.chunk_size)
    else:
        ref_ids = torch.load(args.ref_ids)["ids"]["topk_ids"]
        logp, ent, topk_logp, topk_ids = _reference(hidden, weight, targets, ref_ids, args.chunk_size)
    loss = (c_logp * logp).sum() + (c_ent * ent).sum() + (c_topk * topk_logp).sum()
    loss.backward()
    elapsed = time.perf_counter() - t0
    if exact:
        peak_kb = peak_rss_bytes() // 1024
    else:
        peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    torch.save(
        {
            "logp": logp.detach(),
            "entropy": ent.detach(),
            "topk_logp": topk_logp.detach(),
            "grad_hidden": hidden.grad,
            "grad_weight": weight.grad,
            "ids": {"topk_ids": topk_ids},
        },
        args.child_out,
    )
    print(json.dumps({"peak_mb": (peak_kb - base_kb) / 1024, "time_s": elapsed, "exact": exact}))


# --------------------------------------------------------------------------- #
# Parent: sweep, compare, report
# --------------------------------------------------------------------------- #


def _run_case(path: str, T: int, V: int, args: argparse.Namespace, tmp: Path) -> dict:
    out = tmp / f"{path}_{T}_{V}.pt"
    extra = ["--ref-ids", str(tmp / f"chunked_{T}_{V}.pt")] if path == "ref64" else []
    cmd = [
        sys.executable, str(HERE), "--_child", path,
        "--T", str(T), "--V", str(V), "--hidden", str(args.hidden),
        "--topk", str(args.topk), "--seed", str(args.seed), "--logit-std", str(args.logit_std),
        "--chunk-size", str(args.chunk_size), "--child-out", str(out), *extra,
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or [f"exit {proc.returncode}"]
        return {"error": f"rc={proc.returncode}: {tail[0]}"}
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    res["file"] = out
    return res


def _max_diffs(a_file: Path, b_file: Path) -> dict[str, float]:
    """Max abs difference per saved tensor."""
    import torch

    a, b = torch.load(a_file), torch.load(b_file)
    return {k: (a[k].double() - b[k].double()).abs().max().item() for k in a if k != "ids"}


def _topk_mismatch_rows(a_file: Path, b_file: Path) -> int:
    """Rows whose top-k id sets differ (near-ties broken differently by rounding)."""
    import torch

    a, b = torch.load(a_file)["ids"]["topk_ids"], torch.load(b_file)["ids"]["topk_ids"]
    return int((a.sort(-1).values != b.sort(-1).values).any(-1).sum())


def _vals_grads(d: dict[str, float]) -> tuple[float, float]:
    """(max over the values logp/entropy/top-k logp, max over the gradients)."""
    return max(d["logp"], d["entropy"], d["topk_logp"]), max(d["grad_hidden"], d["grad_weight"])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="T in {256, 1024}, V = 49152 only")
    p.add_argument("--chunk-size", type=int, default=1024)
    p.add_argument("--out", type=Path, default=None, help="append the markdown report to this file")
    p.add_argument("--hidden", type=int, default=64, help="hidden size H")
    p.add_argument("--topk", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    # internal: run one case in this process
    p.add_argument("--logit-std", type=float, default=3.0, help="std of the synthetic logits")
    p.add_argument(
        "--ref",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also run a float64 reference for the error columns (default: on, off with --quick)",
    )
    p.add_argument("--_child", dest="path", choices=["naive", "chunked", "ref64"], help=argparse.SUPPRESS)
    p.add_argument("--T", type=int, help=argparse.SUPPRESS)
    p.add_argument("--V", type=int, help=argparse.SUPPRESS)
    p.add_argument("--child-out", help=argparse.SUPPRESS)
    p.add_argument("--ref-ids", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.path:
        run_child(args)
        return

    use_ref = (not args.quick) if args.ref is None else args.ref
    Ts = [256, 1024] if args.quick else [256, 1024, 4096]
    Vs = [49152] if args.quick else [49152, 151936]
    header = (
        f"chunked (chunk={args.chunk_size}) vs naive full logits, fp32, H={args.hidden}, "
        f"top-k={args.topk}, forward + backward, batch 1, {os.cpu_count()} CPU threads"
    )
    rows, ratios, notes = [], [], set()
    target = None
    with tempfile.TemporaryDirectory() as tmpdir:
        tmp = Path(tmpdir)
        for V in Vs:
            for T in Ts:
                paths = ("naive", "chunked", "ref64") if use_ref else ("naive", "chunked")
                res = {path: _run_case(path, T, V, args, tmp) for path in paths}
                nv, ch = res["naive"], res["chunked"]
                logits_mb = T * V * 4 / 2**20
                row_notes = [f"{k}: {r['error']}" for k, r in res.items() if "error" in r]
                if "error" in nv or "error" in ch:
                    rows.append(f"| {T} | {V} | {logits_mb:.0f} |" + " - |" * 10 + f" {'; '.join(row_notes)} |")
                    continue
                if not (nv["exact"] and ch["exact"]):
                    notes.add("peak via ru_maxrss (clear_refs unavailable): an upper bound")
                d_val, d_grad = _vals_grads(_max_diffs(nv["file"], ch["file"]))
                n_mis = _topk_mismatch_rows(nv["file"], ch["file"])
                if n_mis:
                    row_notes.append(f"top-k ids differ in {n_mis}/{T} rows (near-ties)")
                if "file" in res.get("ref64", {}):
                    full_nv = _max_diffs(nv["file"], res["ref64"]["file"])
                    full_ch = _max_diffs(ch["file"], res["ref64"]["file"])
                    print(f"T={T} V={V} error vs fp64: naive {full_nv}, chunked {full_ch}", file=sys.stderr)
                    e_nv, e_ch = _vals_grads(full_nv), _vals_grads(full_ch)
                    err_cols = f"{e_nv[0]:.1e} / {e_ch[0]:.1e} | {e_nv[1]:.1e} / {e_ch[1]:.1e}"
                else:
                    err_cols = "- | -"
                mem_r = ch["peak_mb"] / nv["peak_mb"]
                time_r = ch["time_s"] / nv["time_s"]
                rows.append(
                    f"| {T} | {V} | {logits_mb:.0f} | {nv['peak_mb']:.0f} | {ch['peak_mb']:.0f} | {mem_r:.3f} "
                    f"| {nv['time_s']:.2f} | {ch['time_s']:.2f} | {time_r:.2f} "
                    f"| {d_val:.1e} | {d_grad:.1e} | {err_cols} | {'; '.join(row_notes)} |"
                )
                ratios.append(f"chunked/naive peak memory at T={T} V={V}: {mem_r:.3f}")
                ratios.append(f"chunked/naive time at T={T} V={V}: {time_r:.2f}")
                if (T, V) == (4096, 49152):
                    ok = mem_r <= 1 / 8
                    target = (
                        f"target at T=4096 V=49152: chunked peak <= 1/8 of naive: {'yes' if ok else 'NO'} "
                        f"({mem_r:.3f}); max abs diff of values vs naive {d_val:.1e}"
                    )
                    if "file" in res.get("ref64", {}):
                        target += f", vs fp64: chunked {e_ch[0]:.1e}, naive {e_nv[0]:.1e}"
                print(rows[-1], file=sys.stderr, flush=True)  # progress

    table = [
        header,
        "",
        "| T | V | [T,V] fp32 MB | naive peak MB | chunked peak MB | mem ratio | naive s | chunked s "
        "| time ratio | max abs diff values | max abs diff grads | values err vs fp64 (naive / chunked) "
        "| grads err vs fp64 (naive / chunked) | note |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        *rows,
        "",
        "values = logp, entropy, top-k logp; grads = d loss / d hidden and d loss / d W; "
        "peak MB = peak RSS above the inputs, fresh process per case; "
        "fp64 reference = the chunked engine in float64 (top-k term at the fp32 chunked run's ids).",
        "",
        *ratios,
        *([target] if target else []),
        *sorted(notes),
    ]
    report = "\n".join(table)
    print(report)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with open(args.out, "a") as f:
            f.write(report + "\n\n")


if __name__ == "__main__":
    main()
