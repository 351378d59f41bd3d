"""tether sft's data: rows read and checked, conversations encoded with an exact per-token loss mask
(token by token, on SmolLM2's real chat template and on the tiny one), and every bad input reported by the
CLI as one ``tether: error:`` line naming the file and line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import assert_clean_error, subprocess_env
from tether.sft.data import ChatEncoder, parse_row, read_conversations
from tether.tasks.base import DataError, Example
from tether.tasks.prompts import encode_prompts

SYSTEM = "Answer with <search> query </search>, read <information>, then <answer> x </answer>."
QUESTION = "Who wrote Hamlet?"
#: a Search-R1 trajectory in the environment's raw format: one assistant message, the observation masked
SEGMENTS = [("<think> I should look it up. </think>\n<search> Hamlet author </search>", True),
            ("\n\n<information>Doc 1(Title: \"Hamlet\") Hamlet is a tragedy by William Shakespeare."
             "</information>\n\n", False),
            ("<answer> William Shakespeare </answer>", True)]


def _segments(segs):
    return [{"text": t, "train": tr} for t, tr in segs]


def write_rows(path: Path, rows) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    """SmolLM2-135M-Instruct's tokenizer, read offline from the embedded GGUF's cache (tether.models)."""
    from transformers import AutoTokenizer

    from tether.models import resolve_model_path

    return AutoTokenizer.from_pretrained(resolve_model_path("smollm2"))


@pytest.fixture(scope="module")
def tiny_tokenizer():
    from tether.testing import make_tiny_tokenizer

    return make_tiny_tokenizer()


@pytest.fixture(params=["smollm2", "tiny"])
def tok(request, smollm2_tokenizer, tiny_tokenizer):
    return smollm2_tokenizer if request.param == "smollm2" else tiny_tokenizer


def _ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def test_raw_trajectory_mask_is_exact_token_by_token(tok):
    """The ids are the prompt tether train encodes, then each segment tokenized on its own, then <|im_end|>;
    exactly the policy's segments and the turn's end are trained, the observation and the prompt are not."""
    conv = parse_row({"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION},
                                   {"role": "assistant", "content": _segments(SEGMENTS)}]}, "row")
    enc = ChatEncoder(tok, 4096, "error").encode(conv)
    prompt = encode_prompts(tok, [Example(QUESTION, "", "")], SYSTEM)[0]  # what the policy sees in tether train
    want_ids, want_train = list(prompt), [False] * len(prompt)
    for text, trained in SEGMENTS:
        want_ids += _ids(tok, text)
        want_train += [trained] * len(_ids(tok, text))
    end = tok.convert_tokens_to_ids("<|im_end|>")
    assert enc.ids == want_ids + [end]
    assert enc.train == want_train + [True]
    trained = "".join(tok.decode([i]) for i, t in zip(enc.ids, enc.train) if t)
    assert trained == SEGMENTS[0][0] + SEGMENTS[2][0] + "<|im_end|>"
    # and the whole is the chat template's own text of the conversation (without the newline after the last turn)
    full = tok.apply_chat_template([{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION},
                                    {"role": "assistant", "content": "".join(t for t, _ in SEGMENTS)}], tokenize=False)
    assert tok.decode(enc.ids) == full[:-1]


def test_multi_turn_chat_trains_assistant_turns_only(tok):
    msgs = [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "<calc>2+2</calc>"},
            {"role": "tool", "content": "4"}, {"role": "assistant", "content": "The answer is 4."},
            {"role": "user", "content": "Thanks"}]  # a turn after the last assistant one adds nothing
    enc = ChatEncoder(tok, 4096, "error").encode(parse_row({"messages": msgs}, "row"))
    spans, cur = [], []  # the trained runs of tokens, decoded
    for i, t in zip(enc.ids, enc.train):
        if t:
            cur.append(i)
        elif cur:
            spans.append(tok.decode(cur))
            cur = []
    spans.append(tok.decode(cur))
    assert spans == ["<calc>2+2</calc><|im_end|>", "The answer is 4.<|im_end|>"]
    assert tok.decode(enc.ids) == tok.apply_chat_template(msgs[:4], tokenize=False)[:-1]
    # the ids up to the second assistant turn: the earlier ones, then the template's text between, masked
    second = tok.apply_chat_template(msgs[:3], tokenize=False, add_generation_prompt=True)
    starts = [i for i in range(1, len(enc.ids)) if enc.train[i] and not enc.train[i - 1]]
    assert len(starts) == 2 and tok.decode(enc.ids[:starts[1]]) == second


def test_prompt_completion_and_a_tokenizer_without_template(tiny_tokenizer):
    row = {"prompt": "What is 2 + 2?", "completion": "4"}
    enc = ChatEncoder(tiny_tokenizer, 64, "error").encode(parse_row(row, "row"))
    same = ChatEncoder(tiny_tokenizer, 64, "error").encode(parse_row(
        {"messages": [{"role": "user", "content": row["prompt"]}, {"role": "assistant", "content": "4"}]}, "row"))
    assert enc.ids == same.ids and enc.train == same.train
    import copy
    plain = copy.deepcopy(tiny_tokenizer)
    plain.chat_template = None
    enc = ChatEncoder(plain, 64, "error").encode(parse_row(row, "row"))
    prompt = encode_prompts(plain, [Example(row["prompt"], "", "")])[0]
    assert enc.ids == prompt + _ids(plain, "4") + [plain.eos_token_id]
    assert enc.train == [False] * len(prompt) + [True] * (len(enc.ids) - len(prompt))
    with pytest.raises(DataError, match="no chat template"):
        ChatEncoder(plain, 64, "error").encode(parse_row({"messages": [
            {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
            {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]}, "f.jsonl line 3"))


def test_max_length_error_or_truncate(tiny_tokenizer):
    conv = parse_row({"prompt": "Hello world", "completion": "Hello world! " * 8}, "f.jsonl line 7")
    full = ChatEncoder(tiny_tokenizer, 1000, "error").encode(conv)
    prompt = full.train.index(True)
    limit = prompt + 4
    with pytest.raises(DataError, match=f"f.jsonl line 7: {len(full.ids)} tokens, more than data.max_length={limit}"):
        ChatEncoder(tiny_tokenizer, limit, "error").encode(conv)
    cut = ChatEncoder(tiny_tokenizer, limit, "truncate").encode(conv)
    assert cut.ids == full.ids[:limit] and cut.train == full.train[:limit] and cut.n_targets == 4
    with pytest.raises(DataError, match=f"line 7: no trained token within its first data.max_length={prompt}"):
        ChatEncoder(tiny_tokenizer, prompt, "truncate").encode(conv)


@pytest.mark.parametrize("row, needle", [
    ('[1, 2]', "expected a JSON object"),
    ({"messages": [{"role": "user", "content": "x"}], "prompt": "y"}, "not both"),
    ({"messages": []}, "non-empty list"),
    ({"messages": [{"role": "user", "content": "x", "weight": 0}]}, "unknown key(s) 'weight'"),
    ({"messages": [{"role": "user", "content": [{"text": "x", "train": True}]}]}, "content of a user message"),
    ({"messages": [{"role": "assistant", "content": [{"text": "x", "train": "yes"}]}]}, "segment 1"),
    ({"messages": [{"role": "assistant", "content": []}]}, "segment list is empty"),
    ({"messages": [{"role": "user", "content": "x"},
                   {"role": "assistant", "content": [{"text": "obs", "train": False}]}]}, "no assistant turn"),
    ({"prompt": "x"}, "needs \"completion\""),
    ({"question": "x"}, "expected \"messages\""),
])
def test_bad_rows_name_the_file_and_line(row, needle, tmp_path):
    f = write_rows(tmp_path / "d.jsonl", [{"prompt": "a", "completion": "b"}, "", row])
    with pytest.raises(DataError) as e:
        read_conversations(f)
    assert f"{f} line 3" in str(e.value) and needle in str(e.value), str(e.value)


def test_read_conversations_hashes_the_file(tmp_path):
    f = write_rows(tmp_path / "d.jsonl", [{"prompt": "a", "completion": "b"}])
    rows, sha = read_conversations(f)
    import hashlib
    assert len(rows) == 1 and sha == hashlib.sha256(f.read_bytes()).hexdigest()


# ---------------------------------------------------------------------------- the CLI, in subprocesses


CASES = {  # name: (rows, extra arguments, what the error line must say besides the file)
    "malformed": ([{"prompt": "a", "completion": "b"}, '{"prompt": "a", "completion": '], [],
                  ["line 2: invalid JSON"]),
    "role": ([{"messages": [{"role": "user", "content": "a"}, {"role": "bot", "content": "b"}]}], [],
             ["line 1: message 2: unknown role 'bot'"]),
    "no_assistant": ([{"prompt": "a", "completion": "b"}, {"messages": [{"role": "user", "content": "a"}]}], [],
                     ["line 2: no assistant turn"]),
    "too_long": ([{"prompt": "a", "completion": "b"}, {"prompt": "Hello world " * 20, "completion": "b"}],
                 ["data.max_length=24"], ["line 2: ", "tokens, more than data.max_length=24"]),
    "empty": ([], [], ["no rows (the file is empty"]),
}


@pytest.mark.slow  # about 9 s: out of the default suite's 15 minutes, run by CI's slow step
def test_cli_bad_input_is_one_error_line_with_file_and_line(tiny_model_dir, tmp_path):
    """The five cases run at once (two cores), each a fresh `python -m tether sft`; none leaves a run directory."""
    procs = {}
    for name, (rows, extra, _) in CASES.items():
        f = write_rows(tmp_path / f"{name}.jsonl", rows)
        cmd = [sys.executable, "-m", "tether", "sft", "--data", str(f), "--model", str(tiny_model_dir),
               "--output-dir", str(tmp_path / f"run-{name}"), "run.progress=false", *extra]
        procs[name] = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                       env=subprocess_env())
    for name, p in procs.items():
        _, err = p.communicate(timeout=240)
        assert_clean_error(p.returncode, err, str(tmp_path / f"{name}.jsonl"), *CASES[name][2], line_only=True)
        assert not (tmp_path / f"run-{name}").exists(), name  # a bad row leaves no directory behind
