"""The model organism: a small Llama that tether builds itself, on which an RL run takes minutes.

``model.name=organism`` (any command) resolves to it. The first use builds it, deterministically and
offline, into the cache (``$TETHER_CACHE`` or ``~/.cache/tether``, the GGUF cache's place), under a name
keyed by the content of its build spec; later uses, by any process, reuse that directory:

1. a character-level tokenizer (:func:`char_tokenizer`: printable ASCII, one token a character, the
   ChatML special tokens), so the organism reads any text an environment shows it;
2. a randomly initialised Llama of :class:`OrganismSpec`'s shape;
3. ``tether sft`` (a subprocess of this Python) in two phases on generated, verified solutions of
   :mod:`tether.tasks.organism_problems` (difficulties 1-3; :func:`sft_rows`): first the skills (plain problems
   ``Q:`` worked one operation a line; calculator episodes ``C:`` worked by hand or by one call of the
   calculator, ``<calc>`` the whole expression, its ``<result>`` masked), then the choice (the same mixture,
   but a share of the difficulty-3 rows answered directly, ``#### 73``);
4. ``tether export`` of the last SFT run into the cache directory.

What it leaves for RL: a choice it makes badly. It has learnt to work a problem line by line, and to
answer it directly; greedy decoding mostly answers directly, which at difficulty 3 (``data.task=organism``)
is rarely right, while sampling works it out often enough for RL to find it. In the calculator
environment (``rollout.agent=multi_turn rollout.agent.env.name=organism_calc``) the same holds for calling the tool.
docs/organism.md has the measured figures.

Several processes asking at once (a sweep's lanes) build it once: the build holds a lock in the cache,
and the others wait for it, then read the finished directory.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import os
import random
import shutil
import string
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from ..errors import ModelLoadError
from ..gguf import default_cache_dir
from ..procs import die_with_parent
from ..tasks.organism_problems import CALC, QUESTION, draw, expression, solution_text, solve
from ..userio import loads_json

__all__ = ["ORGANISM_MODEL_NAME", "OrganismSpec", "char_tokenizer", "organism_path", "build_organism",
           "sft_rows", "DEFAULT_SPEC"]

#: ``model.name`` of the organism.
ORGANISM_MODEL_NAME = "organism"
#: Bumped whenever the build itself (not its spec) changes what it makes: part of the cache key.
BUILD_VERSION = 1
_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<pad>"]
_CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@dataclass(frozen=True)
class OrganismSpec:
    """Everything that determines the organism (its cache key is a hash of these and BUILD_VERSION)."""

    hidden_size: int = 128  # model width
    layers: int = 4  # transformer blocks
    heads: int = 4  # attention heads (as many key-value heads)
    context: int = 256  # max_position_embeddings: prompt + response tokens
    difficulty_mix: tuple = (0.3, 0.4, 0.3)  # share of difficulty 1, 2, 3 among the rows
    calc_share: float = 0.2  # share of rows that are calculator-environment episodes (prompt "C:")
    call_share: float = 0.3  # of those, the share that call the calculator with the whole expression (the rest are
    # answered as plain rows are)
    steps: int = 1500  # phase 1 (the skills): SFT steps on rows all worked line by line (or calling the calculator),
    # each row seen once
    batch_size: int = 64  # rows per SFT step
    lr: float = 3e-3  # phase 1's peak learning rate (cosine to 0 after warm-up)
    warmup_steps: int = 100  # phase 1's linear warm-up steps (at most a tenth of the steps)
    choice_steps: int = 150  # phase 2 (the choice): SFT steps from phase 1's weights on new rows in which a share
    # of the difficulty-3 problems is answered directly (0 = no phase 2)
    choice_lr: float = 1e-3  # phase 2's peak learning rate (cosine to 0 after a tenth of its steps)
    direct_share: float = 0.6  # phase 2: share of the difficulty-3 rows (not calling) answered directly ("#### 73"):
    # the organism keeps both ways, greedy decoding mostly answers directly, which it gets right far less often
    # than the worked way (the choice RL can change, docs/organism.md)
    seed: int = 0  # seeds the rows, the initialization and the SFT order

    def key(self) -> str:
        """The cache key: a hash of the spec and the build's version."""
        blob = json.dumps({"version": BUILD_VERSION, **dataclasses.asdict(self)}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


DEFAULT_SPEC = OrganismSpec()


def char_tokenizer():
    """A character-level tokenizer: the ChatML specials (ids 0-3), then one token per printable ASCII
    character (``string.printable``, tab and newline included); eos ``<|im_end|>``, pad ``<pad>``, left
    padding, a ChatML chat template. Text outside that alphabet maps to ``<|endoftext|>`` (unknown)."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    chars = sorted(set(string.printable) - set("\x0b\x0c\r"))
    vocab = {t: i for i, t in enumerate(_SPECIALS + chars)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<|endoftext|>"))
    tok.add_special_tokens(_SPECIALS)
    tok.decoder = decoders.Fuse()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<|endoftext|>", bos_token="<|im_start|>",
                                 eos_token="<|im_end|>", pad_token="<pad>", padding_side="left")
    hf.chat_template = _CHATML
    return hf


def sft_rows(spec: OrganismSpec, phase: int = 1) -> list[dict]:
    """The SFT rows of a phase (docs/sft.md's formats), a pure function of ``spec`` and ``phase``: plain problems
    as prompt / completion pairs worked line by line (phase 2: difficulty 3 also answered directly); calculator
    episodes solved the same ways or by one call, the call's ``<result>`` a masked segment exactly as the
    ``organism_calc`` environment shows it. Phase 2 draws problems after phase 1's."""
    rng = random.Random(f"organism-rows|{spec.seed}|{phase}")
    n1 = spec.steps * spec.batch_size
    rows = []
    for i in range(n1) if phase == 1 else range(n1, n1 + spec.choice_steps * spec.batch_size):
        d = rng.choices((1, 2, 3), weights=spec.difficulty_mix)[0]
        start, ops = draw("train", spec.seed, d, i)
        expr, answer = expression(start, ops), solve(start, ops)[-1]
        calc = rng.random() < spec.calc_share
        if not calc or rng.random() >= spec.call_share:
            worked = phase == 1 or d < 3 or rng.random() >= spec.direct_share
            completion = solution_text(start, ops) if worked else f"#### {answer}"
            rows.append({"prompt": (CALC if calc else QUESTION) + expr, "completion": completion})
        else:
            rows.append({"messages": [{"role": "user", "content": CALC + expr}, {"role": "assistant", "content": [
                {"text": f"<calc>{expr}</calc>", "train": True},
                {"text": f"<result>{answer}</result>", "train": False},
                {"text": f"\n#### {answer}", "train": True}]}]})
    return rows


def _write_base(spec: OrganismSpec, path: Path) -> None:
    """The randomly initialised model and the tokenizer, as a Hugging Face directory."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    tok = char_tokenizer()
    config = LlamaConfig(vocab_size=len(tok), hidden_size=spec.hidden_size, intermediate_size=3 * spec.hidden_size,
                         num_hidden_layers=spec.layers, num_attention_heads=spec.heads, num_key_value_heads=spec.heads,
                         max_position_embeddings=spec.context, bos_token_id=tok.bos_token_id,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, tie_word_embeddings=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                               pad_token_id=tok.pad_token_id)
    model.save_pretrained(path)
    tok.save_pretrained(path)


def _tether(args: list[str], log: Callable[[str], None], progress: Optional[Path] = None, total: int = 0) -> None:
    """Run ``python -m tether ARGS`` (this interpreter) with every core's thread (the build is one process,
    whatever the caller's thread limit), logging the SFT step reached in ``progress`` (a metrics.jsonl)
    every 30 s; a failure is a ModelLoadError carrying the tail of its output."""
    threads = str(os.cpu_count() or 1)
    env = dict(os.environ, OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads,
               PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH", "")]))
    with tempfile.TemporaryFile("w+") as out:
        p = subprocess.Popen([sys.executable, "-m", "tether", *args], stdout=out, stderr=subprocess.STDOUT, text=True,
                             env=env, preexec_fn=die_with_parent())  # a kill -9 of the build ends it too
        while True:
            try:
                p.wait(timeout=30)
                break
            except subprocess.TimeoutExpired:
                if progress is not None and progress.is_file():
                    rows = progress.read_text().splitlines()
                    try:
                        last = loads_json(rows[-1]) if rows else {}
                    except ValueError:  # a row being written
                        last = {}
                    loss = last.get("loss", float("nan"))
                    log(f"[tether] organism: SFT step {last.get('step', 0)}/{total}, loss {loss:.3f}")
        if p.returncode != 0:
            out.seek(0)
            tail = "\n".join(out.read().strip().splitlines()[-15:])
            raise ModelLoadError(f"building the organism: `tether {args[0]}` failed (exit {p.returncode}):\n{tail}")


def _build(spec: OrganismSpec, final: Path, log: Callable[[str], None]) -> None:
    """Build into a temporary directory beside ``final`` and rename it into place."""
    work = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        t0 = time.time()
        _write_base(spec, work / "base")
        log(f"[tether] building the organism ({spec.steps} + {spec.choice_steps} SFT steps; once, cached in {final})")
        model = work / "base"
        for phase, steps, lr, warmup in ((1, spec.steps, spec.lr, min(spec.warmup_steps, spec.steps // 10)),
                                         (2, spec.choice_steps, spec.choice_lr, spec.choice_steps // 10)):
            if steps == 0:
                continue
            with open(work / f"rows{phase}.jsonl", "w") as f:
                for row in sft_rows(spec, phase):
                    f.write(json.dumps(row) + "\n")
            run = work / f"sft{phase}"
            _tether(["sft", "--data", str(work / f"rows{phase}.jsonl"), "--model", str(model), "--output-dir", str(run),
                     f"train.steps={steps}", f"train.batch_size={spec.batch_size}",
                     f"train.micro_batch_size={spec.batch_size}", f"train.lr={lr}", f"train.warmup_steps={warmup}",
                     f"train.seed={spec.seed}", "run.progress=false", "run.plot=false", f"run.save_every={steps}",
                     "run.keep_checkpoints=1"], log, progress=run / "metrics.jsonl", total=steps)
            model = run
        _tether(["export", str(model), str(work / "model")], log)
        seconds = time.time() - t0
        (work / "model" / MANIFEST).write_text(json.dumps(
            {"spec": dataclasses.asdict(spec), "key": spec.key(), "build_version": BUILD_VERSION,
             "build_seconds": round(seconds, 1), "files": _file_hashes(work / "model")}, indent=1) + "\n")
        os.replace(work / "model", final)
        log(f"[tether] organism built in {seconds:.0f} s")
    finally:
        shutil.rmtree(work, ignore_errors=True)


MANIFEST = "organism.json"  # written last, with the hash of every other file: a build is complete when it is there


def _file_hashes(d: Path) -> dict:
    """``{name: {"bytes": size, "sha256": hex}}`` of the files in directory ``d`` (what a use verifies)."""
    out = {}
    for p in sorted(d.iterdir()):
        if p.is_file() and p.name != MANIFEST:
            h = hashlib.sha256()
            with open(p, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    h.update(block)
            out[p.name] = {"bytes": p.stat().st_size, "sha256": h.hexdigest()}
    return out


def verify_cached(final: Path) -> None:
    """Check a cached organism against the hashes its build recorded; a damaged one is a ModelLoadError saying what
    to do (a build of before the hashes were recorded, 2026-12-05, is trusted on its manifest alone)."""
    fix = f"delete the directory (rm -r {final}) and run again: it is rebuilt, once (about 10 minutes)"
    try:
        manifest = loads_json((final / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"the cached organism {final} is damaged ({MANIFEST}: {e}); {fix}") from None
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict):
        return
    now = _file_hashes(final)
    for name, want in files.items():
        got = now.get(name)
        if got != want:
            why = "missing" if got is None else (f"{got['bytes']} bytes, the build wrote {want.get('bytes')}"
                                                 if got["bytes"] != want.get("bytes") else "its content changed")
            raise ModelLoadError(f"the cached organism {final} is damaged ({name}: {why}); {fix}")


def _clear_the_way(final: Path, log: Callable[[str], None]) -> None:
    """Under the build lock: remove the temporary directories of builds that died (another live build would hold
    the lock), and move aside an entry at ``final`` without a manifest (a damaged build, or a directory of
    something else: kept, renamed ``<name>.damaged-<time>``) so that the finished build can take its place."""
    for tmp in final.parent.glob(f".{final.name}.tmp-*"):
        shutil.rmtree(tmp, ignore_errors=True)
    if final.exists() or final.is_symlink():
        aside = final.with_name(f"{final.name}.damaged-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}")
        try:
            os.replace(final, aside)
        except OSError as e:
            raise ModelLoadError(f"{final} exists but is not a complete organism (no {MANIFEST}), and cannot be "
                                 f"moved aside ({e.strerror or e}): remove it and run again") from None
        log(f"[tether] {final} was not a complete organism (no {MANIFEST}): moved aside to {aside.name}; building "
            f"anew")


def organism_path(spec: Optional[OrganismSpec] = None, cache_dir: str | os.PathLike | None = None) -> Path:
    """Where ``spec``'s organism (default: :data:`DEFAULT_SPEC`) lives in the cache (built or not)."""
    spec = spec or DEFAULT_SPEC
    root = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    return root / f"organism-{spec.key()}"


def build_organism(spec: Optional[OrganismSpec] = None, cache_dir: str | os.PathLike | None = None,
                   log: Optional[Callable[[str], None]] = None) -> Path:
    """The organism's Hugging Face directory (``spec`` default: :data:`DEFAULT_SPEC`), built on first use
    (module docstring) and reused after."""
    spec = spec or DEFAULT_SPEC
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    final = organism_path(spec, cache_dir)
    if (final / MANIFEST).is_file():
        verify_cached(final)
        return final
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        lock = open(final.parent / f".{final.name}.lock", "w")
    except OSError as e:
        raise ModelLoadError(f"cannot build the organism in {final.parent}: {e.strerror or e}") from None
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process building it: wait, then reuse its result
        if not (final / MANIFEST).is_file():
            _clear_the_way(final, log)
            _build(spec, final, log)
    verify_cached(final)
    return final
