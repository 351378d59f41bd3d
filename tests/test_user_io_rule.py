"""The rule of `tether.userio`, held by the source itself: what a user hands tether is parsed there, and a path a
user names for an output is claimed there.

Read with ``ast`` (nothing imported): a call of ``json.loads`` / ``json.load`` / ``yaml.safe_load`` / ``yaml.load``
(and their siblings), or a write (``open`` in a writing mode, ``os.fdopen`` likewise, ``os.open`` with a writing
flag, ``Path.write_text`` / ``write_bytes``, ``savefig``) anywhere under ``src/`` outside `tether.userio` fails
the test, unless the function holding it is in `ALLOWED`, with the reason it writes only where tether owns the
place (a run directory its guard claimed, a cache, a directory claimed by `check_replaceable`). Each round of fault
probes had found the same defects again in new code (deep JSON as a traceback, an ``--out`` replacing a user's file,
an unwritable destination found after the work): this test is where new code meets the rule.
"""

from __future__ import annotations

import ast
from pathlib import Path

import tether

SRC = Path(tether.__file__).resolve().parent  # .../src/tether

PARSERS = {("json", "loads"), ("json", "load"), ("yaml", "safe_load"), ("yaml", "load"), ("yaml", "full_load"),
           ("yaml", "unsafe_load"), ("yaml", "safe_load_all"), ("yaml", "load_all")}
WRITERS = {"write_text", "write_bytes", "savefig"}
WRITE_FLAGS = ("O_WRONLY", "O_RDWR", "O_CREAT", "O_APPEND", "O_TRUNC")

#: module (relative to src/tether) : function -> why its writes or parses are not at a path a user named
ALLOWED: dict[str, str] = {
    "userio.py:*": "the helpers themselves",
    "cli.py:main": "/dev/null over a stdout its reader closed (a broken pipe), so that Python's final flush is quiet",
    "eval/cli.py:_evaluate_bench": "OUT/<benchmark>.jsonl inside --out, which _open_out claimed before the model "
                                   "loaded (rundir.owned.check_replaceable, its marker written)",
    "eval/cli.py:_evaluate_bench.append": "the same file, appended as batches finish",
    "export.py:_write_export": "README.md in the temporary directory that becomes the export (claimed by "
                               "check_replaceable before the model loaded)",
    "export.py:_add_legacy_config_keys": "config.json of the export being written (same claim)",
    "gguf.py:file_digest": "the GGUF conversion cache ($TETHER_CACHE), tether's own",
    "gguf.py:_strip_quantization_config_file": "config.json of a model tether converted into its cache",
    "gguf.py:convert_gguf": "the conversion cache, tether's own",
    "metrics.py:write_text_atomic": "files of a run directory (rundir.guard claimed it; checkpoints, logs)",
    "metrics.py:JsonlWriter.__init__": "metrics.jsonl / samples.jsonl of a claimed run directory",
    "organism/build.py:_build": "a temporary directory in tether's cache",
    "organism/build.py:build_organism": "the build's lock file in tether's cache",
    "plot.py:_save": "the image path claim_plot_path claimed (userio.claim_output_file) before drawing",
    "report.py:RewardErrorLog.add": "reward_errors.log of a claimed run directory",
    "rollout/servers.py:ServerGroup._launch": "the launched vLLM servers' logs, in RUN/servers/ (a claimed run "
                                              "directory) or a temporary directory",
    "rundir/guard.py:RunLock.acquire": "the .lock of the run directory being claimed (its own rule)",
    "rundir/owned.py:write_marker": "the marker of a directory check_replaceable allowed",
    "search/bm25.py:BM25Retriever._build": "a new index directory (retriever_base.index_dir: tether's cache or a "
                                           "fresh <corpus>.bm25-<hash> beside the corpus), renamed into place",
    "search/dense.py:DenseRetriever.__init__": "the same, for the dense index",
    "sweep/layout.py:_write_json": "sweep.json and run records inside the sweep's --out (claim_sweep_dir)",
    "sweep/report.py:_save": "the report's PNG, claimed with its .md and .json (claim_report_paths) before computing",
    "sweep/runner.py:_start": "a run's .out / .err logs inside the claimed --out",
    "sweep/runner.py:share_lock": "the share's lock file inside the claimed --out",
    "tasks/reward_worker.py:main": "a duplicate of the worker's own stdout pipe (its reply channel)",
}


def _mode(call: ast.Call) -> str:
    if len(call.args) >= 2:
        return ast.unparse(call.args[1])
    for k in call.keywords:
        if k.arg == "mode":
            return ast.unparse(k.value)
    return "'r'"


def raw_calls(source: str) -> list[tuple[str, int, str]]:
    """(function qualname, line, what) of every raw parse or write in ``source``."""
    out: list[tuple[str, int, str]] = []

    def visit(node: ast.AST, stack: list[str]) -> None:
        for child in ast.iter_child_nodes(node):
            inner = stack + [child.name] if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                                 ast.ClassDef)) else stack
            if isinstance(child, ast.Call):
                f, what = child.func, None
                if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and (f.value.id, f.attr) in PARSERS:
                    what = f"{f.value.id}.{f.attr}"
                elif isinstance(f, ast.Attribute) and f.attr in WRITERS:
                    what = f".{f.attr}()"
                elif (isinstance(f, ast.Name) and f.id == "open") or (isinstance(f, ast.Attribute)
                                                                      and f.attr == "fdopen"):
                    mode = _mode(child)
                    if not (mode.startswith(("'", '"')) and not any(c in mode for c in "wax+")):
                        what = f"open(mode={mode})"
                elif isinstance(f, ast.Attribute) and f.attr == "open" and isinstance(f.value, ast.Name) \
                        and f.value.id == "os" and any(flag in ast.unparse(child) for flag in WRITE_FLAGS):
                    what = "os.open(for writing)"
                if what:
                    out.append((".".join(stack) or "<module>", child.lineno, what))
            visit(child, inner)

    visit(ast.parse(source), [])
    return out


def violations(root: Path = SRC, allowed: dict[str, str] = ALLOWED) -> list[str]:
    bad = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if f"{rel}:*" in allowed:
            continue
        for func, line, what in raw_calls(path.read_text(encoding="utf-8")):
            if f"{rel}:{func}" not in allowed:
                bad.append(f"{rel}:{line} in {func}: {what}")
    return bad


def test_no_raw_parse_or_write_outside_the_helpers():
    bad = violations()
    assert not bad, ("parse what a user hands tether with tether.userio (loads_json, read_json, loads_yaml, "
                     "read_yaml_mapping) and claim a path a user named with claim_output_file / claim_output_dir "
                     "(write it with output_writer); or, for a place tether owns, add the function to ALLOWED with "
                     "its reason:\n  " + "\n  ".join(bad))


def test_every_allowed_entry_still_exists():
    """An allow-list entry whose function no longer parses or writes anything is stale: it would let a new raw
    call in unseen."""
    stale = []
    for entry in ALLOWED:
        rel, func = entry.split(":")
        if func == "*":
            continue
        path = SRC / rel
        if not path.is_file() or func not in {f for f, _, _ in raw_calls(path.read_text(encoding="utf-8"))}:
            stale.append(entry)
    assert not stale, f"stale ALLOWED entries (remove them): {stale}"


def test_the_rule_catches_each_kind_of_raw_call(tmp_path):
    """Today's raw calls put back are caught: the record reader of `tether sweep report` parsing with json.loads
    (defect 4 of issue #51), the report writing its markdown with write_text (defect 1), eval's --env-options
    through yaml.safe_load (defect 6), and a writer opened by hand."""
    pkg = tmp_path / "tether"
    (pkg / "sweep").mkdir(parents=True)
    (pkg / "sweep" / "layout.py").write_text(
        "import json\n\ndef read_record(path):\n    return json.loads(path.read_text())\n")
    (pkg / "sweep" / "report.py").write_text("def write_report(md, text):\n    md.write_text(text)\n")
    (pkg / "eval.py").write_text("import yaml\n\ndef _options(text):\n    return yaml.safe_load(text)\n")
    (pkg / "w.py").write_text("def dump(p, mode='w'):\n    with open(p, mode) as f:\n        f.write('x')\n"
                              "\ndef read(p):\n    return open(p).read() + open(p, 'rb').read().decode()\n")
    bad = violations(pkg, {})
    assert bad == ["eval.py:4 in _options: yaml.safe_load", "sweep/layout.py:4 in read_record: json.loads",
                   "sweep/report.py:2 in write_report: .write_text()", "w.py:2 in dump: open(mode=mode)"], bad
    # the real tree's own functions, with the allow-list dropped, are caught the same way
    real = violations(SRC, {"userio.py:*": ""})
    assert any(v.startswith("sweep/report.py:") and "_save: .savefig()" in v for v in real), real
