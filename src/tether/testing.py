"""Helpers for tests: a tiny, offline, randomly initialised causal LM with a real tokenizer.

Nothing here touches the network. `make_tiny_model_dir` writes a directory that
`transformers.AutoModelForCausalLM.from_pretrained` / `AutoTokenizer.from_pretrained`
(and therefore `tether.models.load_model`) can load like any Hugging Face checkpoint:
a small Llama with random weights and a byte-level BPE tokenizer trained in memory on
a fixed corpus, with a ChatML chat template and distinct EOS and pad tokens.

The model is random, so its text is gibberish; it is meant for testing shapes, masks,
padding, sampling plumbing and the training loop, in well under a second per call.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .rollout import ENGINES

#: Special tokens of the tiny tokenizer, in id order (ids 0..3).
TINY_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<pad>"]

#: ChatML template, the same format SmolLM2 uses (without its default system prompt).
TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# A fixed, small training corpus for the BPE tokenizer: a little English, arithmetic
# and the answer formats the math tasks use, so that common test strings tokenize
# into a handful of tokens.
_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "What is 2 + 2? The answer is 4.",
    "Compute 12 * 7 = 84. Then 84 - 4 = 80, so the answer is \\boxed{80}.",
    "Let x be a number such that 3x + 5 = 20. Then x = 5.",
    "Question: how many apples are left? Answer: 3 apples.",
    "Hello world! Hello there. Goodbye world.",
    "<think> reasoning step by step </think> <answer> 42 </answer>",
    "0 1 2 3 4 5 6 7 8 9 10 11 12 100 1000 + - * / = ( ) [ ] { }",
    "the of and to in is that for it as with was on be at by this",
    "user assistant system You are a helpful assistant.",
]


def make_tiny_tokenizer(vocab: int = 384):
    """Build a small byte-level BPE tokenizer offline and wrap it for transformers.

    Args:
        vocab: target vocabulary size (including the 256 byte tokens and the 4 special
            tokens); the fixed corpus may yield slightly fewer merges than asked for.

    Returns:
        A `transformers.PreTrainedTokenizerFast` with eos ``<|im_end|>`` (id 2), pad
        ``<pad>`` (id 3), bos ``<|im_start|>`` (id 1), unk ``<|endoftext|>`` (id 0),
        a ChatML chat template and ``padding_side="left"``. Building it is
        deterministic: the same `vocab` gives the same tokenizer.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab < 256 + len(TINY_SPECIAL_TOKENS):
        raise ValueError(f"vocab must be >= {256 + len(TINY_SPECIAL_TOKENS)} (byte alphabet + specials), got {vocab}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=list(TINY_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS, trainer=trainer)
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<|endoftext|>",
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<pad>",
        padding_side="left",
    )
    hf_tok.chat_template = TINY_CHAT_TEMPLATE
    return hf_tok


def make_tiny_model_dir(
    path: str | Path,
    vocab: int = 384,
    seed: int = 0,
    hidden_size: int = 32,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 64,
    initializer_range: float = 0.2,
    tie_word_embeddings: bool = False,
) -> Path:
    """Write a tiny random Llama causal LM plus its tokenizer to `path` and return it.

    Args:
        path: directory to create (parents too); existing files in it are overwritten.
        vocab: tokenizer vocabulary size target (see `make_tiny_tokenizer`); the model's
            vocabulary is the tokenizer's actual size.
        seed: seed for the random weights (the global torch RNG is left untouched).
        hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size: model shape.
        initializer_range: std of the random weights. Larger than the usual 0.02 so that the
            next-token distributions are peaked; greedy decoding is then robust to the tiny
            numerical differences that padding introduces.
        tie_word_embeddings: share one tensor between the input embeddings and the LM head
            (as SmolLM2 does).

    Returns:
        The directory, loadable with `AutoModelForCausalLM.from_pretrained` and
        `AutoTokenizer.from_pretrained` (safetensors weights, `generation_config.json`
        with eos/pad ids, tokenizer with chat template and pad token).
    """
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = make_tiny_tokenizer(vocab)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=1024,
        initializer_range=initializer_range,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=tie_word_embeddings,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id
    )
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


class ScriptedEngine:
    """A rollout engine whose responses depend only on the prompt's tokens and the sample index.

    Sample ``j`` of prompt ``p`` is the same token sequence whatever the batch, the rank, the
    step or the seed, so a data-parallel run and a single-process run of the same global batch
    train on exactly the same rollouts (``tests/test_distributed.py``). Lengths vary from 1 to
    ``max_new_tokens``; a row shorter than that ends with EOS (finish reason ``stop``).
    """

    def __init__(self, model, tokenizer):
        from .rollout.hf import HFEngine  # deferred: pulls in transformers

        self._hf = HFEngine(model, tokenizer)  # for the EOS/pad ids and the batch assembly
        self.tokenizer = tokenizer

    def sync_weights(self, model) -> None:
        pass

    def generate(self, prompts, params):
        import zlib

        vocab, eos = len(self.tokenizer), self._hf.eos_token_ids[0]
        row_group, results = [], []
        for g, p in enumerate(prompts):
            for j in range(params.n):
                gen = torch.Generator().manual_seed(zlib.crc32(f"{list(map(int, p))}:{j}".encode()))
                n = int(torch.randint(1, params.max_new_tokens + 1, (1,), generator=gen))
                toks = torch.randint(len(TINY_SPECIAL_TOKENS), vocab, (n,), generator=gen).tolist()
                reason = "length" if n == params.max_new_tokens else "stop"
                if reason == "stop":
                    toks[-1] = eos
                row_group.append(g)
                results.append((toks, reason, self.tokenizer.decode(toks, skip_special_tokens=True)))
        return self._hf.assemble([list(map(int, p)) for p in prompts], row_group, results)


def register_scripted_engine(name: str = "scripted") -> None:
    """Make ``rollout.engine=<name>`` build a `ScriptedEngine` (tests only)."""
    ENGINES[name] = lambda cfg, model, tokenizer, **overrides: ScriptedEngine(model, tokenizer)
