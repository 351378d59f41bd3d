"""`HFEngine`: rollouts with Hugging Face ``model.generate`` on the training model itself.

No second copy of the weights: the engine samples from the very module the trainer
optimizes, so `sync_weights` has nothing to do. Each `generate` call

1. expands every prompt ``n`` times (rows of a prompt contiguous),
2. orders the rows by prompt length (longest first) and cuts them into sub-batches of
   ``batch_size`` sequences, so each sub-batch carries little left padding,
3. pre-fills each distinct prompt of a sub-batch once and expands its KV cache to the
   prompt's ``n`` rows (``share_prompt``), then
4. runs ``model.generate`` per sub-batch in eval mode under ``torch.no_grad`` with the KV
   cache on (``use_cache=True``, even if training disabled it for gradient checkpointing),
   then restores the previous train/eval mode. The cache is `kvcache.growing_cache`, sized
   for prompt + ``max_new_tokens`` and written in place, not transformers' ``DynamicCache``
   that re-copies itself at every token,
5. post-processes every row: cut after the first EOS (EOS kept, mask True) or right after
   the token that completes a stop string, and records the finish reason,
6. restores the original row order and pads everything into a `RolloutBatch`.

Sampling distribution. Only the requested knobs are applied (temperature, top-p, top-k;
argmax when greedy). The draw itself is `_InverseCDFSampler`, a logits processor run under
``do_sample=False``: it applies transformers' own temperature / top-k / top-p warpers, draws
one token per row by inverse-CDF search, and leaves a one-hot score that ``generate``'s argmax
picks. The law is the same as ``do_sample=True``, but ``torch.multinomial`` draws one
exponential per vocabulary entry where this draws one uniform per row (the cost of each is
measured by ``bench/decode_speed.py``, docs/benchmarks.md). Knobs that a checkpoint's
``generation_config.json`` may set and that would change the distribution the policy-gradient
assumes (repetition penalty, n-gram blocking, min-p, typical-p, epsilon/eta cutoffs, a default top-k of
50) are explicitly neutralized, because transformers 5.x fills every generate argument left unset from the
model's generation config.

Stop strings. A stopping criterion decodes each unfinished row's *response* tokens (special
tokens skipped) after every step and ends the row once the text contains a stop string, so
generation stops early and saves compute. The same rule is re-applied afterwards to find
the exact cut: the shortest token prefix whose decoded text contains a stop string.
transformers' own ``stop_strings=`` option is deliberately not used: it matches over the
whole sequence including the prompt, so a stop string that begins in the prompt (e.g.
``"\\n\\n"`` after a chat template ending in ``"\\n"``) would end a response at its first
token.

Non-finite logits. A model whose weights have diverged (e.g. at a learning rate far too high)
gives NaN or infinite logits, and sampling from them would draw garbage: the inverse-CDF
search would return an index past the vocabulary, greedy argmax an arbitrary token. Every
decode step therefore marks such rows in a flag that stays on the device (no host sync per
token): the sampler reads it off the total probability mass it already sums (free), and
`_FiniteGuard` takes one max over the logits for greedy and ``multinomial`` decoding. The
bad rows are given a harmless token so that ``generate`` finishes its segment; the flag is
read once per segment, where `_generate_chunk` syncs anyway, and raises a ``GenerationError``.

Sessions (multi-turn). ``generate(..., sessions=keys)`` keeps, per output row, the KV of the row's
prompt + response under its key, and a later call whose prompt for that key extends those tokens
encodes only the new ones (``sessions.py`` has the layout, the memory cost and the limits;
``release`` frees entries, ``sync_weights`` drops them all). Rows are ordered and cut into
sub-batches as without sessions, so with a seed the sampled ids are the same with and without
reuse (``reuse_kv=False``). ``record_logp`` fills ``RolloutBatch.sampler_logp`` (`sessions.StepLogp`).

Seeding. With ``params.seed`` set, the call runs inside ``torch.random.fork_rng`` (CPU and
the model's CUDA device) after ``torch.manual_seed(seed)``: the same prompts, params,
``batch_size`` and device give the same output, and the global RNG state is left as it
was. Results depend on ``batch_size`` (rows draw from one RNG stream in sub-batch order).
Without a seed, sampling draws from (and advances) the global RNG.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Hashable, Iterable, Optional

import torch
from transformers import DynamicCache, LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from ..errors import GenerationError
from ..logprobs import cache_kwarg
from .base import NONFINITE_LOGITS, RolloutBatch, SamplingParams
from .kvcache import growing_cache, shared_prefill
from .rows import RowPostprocess, eos_and_pad
from .sessions import SessionStore, StepLogp, layout, prefill, take_rows


def _model_device(model) -> torch.device:
    """Device of the model's first parameter."""
    dev = getattr(model, "device", None)
    if isinstance(dev, torch.device):
        return dev
    return next(model.parameters()).device


def _generation_config(model):
    """The generation config transformers will merge into generate() calls (unwrapping peft)."""
    base = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    return getattr(base, "generation_config", None)


class _StopOnStrings(StoppingCriteria):
    """Stopping criterion: a row is done once its decoded response contains any stop string.

    Only the response part (columns from `prompt_len`) is decoded, with special tokens
    skipped. Rows already done, or already ended by an EOS, are not decoded again.
    """

    def __init__(self, tokenizer, stops: list[str], prompt_len: int, eos_ids: list[int]):
        self.tokenizer = tokenizer
        self.stops = stops
        self.prompt_len = prompt_len
        self.eos_ids = torch.tensor(eos_ids, dtype=torch.long)
        self.done: torch.Tensor | None = None

    def __call__(self, input_ids: torch.LongTensor, scores=None, **kwargs) -> torch.BoolTensor:
        if self.done is None:
            self.done = torch.zeros(input_ids.shape[0], dtype=torch.bool)
        resp = input_ids[:, self.prompt_len :].cpu()
        ended = torch.isin(resp, self.eos_ids).any(dim=1)
        rows = (~self.done & ~ended).nonzero().flatten().tolist()
        if rows:
            texts = self.tokenizer.batch_decode(resp[rows].tolist(), skip_special_tokens=True)
            for i, text in zip(rows, texts):
                if any(s in text for s in self.stops):
                    self.done[i] = True
        return self.done.to(input_ids.device)


class _InverseCDFSampler(LogitsProcessor):
    """Draw the next token by inverse-CDF search; return scores whose argmax is the draw.

    Applies the temperature, top-k and top-p warpers of ``do_sample=True`` (same classes, same
    order), then for each row draws ``u ~ U[0, total mass)`` and picks the token whose
    cumulative-probability interval holds ``u``. The search is two-level so that it stays
    exact without a float64 cumulative sum over the whole vocabulary: float64 sums of blocks
    of ``block`` tokens select a block, then a float64 cumulative sum inside that block only
    selects the token. Every token is drawn with its float32 softmax probability up to float64
    rounding (tokens of probability 0, e.g. cut by top-p, are never drawn). One uniform per
    row is drawn from the torch RNG of the scores' device, so seeding works as for
    ``do_sample=True`` (the streams differ, the law does not).
    """

    def __init__(self, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, block: int = 1024):
        self.nonfinite: torch.Tensor | None = None  # True once a row had no finite distribution (see the module doc)
        self.warpers = []
        if temperature != 1.0:
            self.warpers.append(TemperatureLogitsWarper(float(temperature)))
        if top_k:
            self.warpers.append(TopKLogitsWarper(top_k=int(top_k)))
        if top_p < 1.0:
            self.warpers.append(TopPLogitsWarper(top_p=float(top_p)))
        self.block = int(block)

    @torch.no_grad()
    def draw(self, scores: torch.Tensor, uniform: torch.Tensor | None = None, flag=None) -> torch.Tensor:
        """Token ids ``[rows]`` drawn from ``softmax(warped scores)``.

        ``uniform`` (``[rows, 1]`` float64 in ``[0, 1)``) replaces the random draw; the tests
        sweep it over a grid to check the token-interval lengths against the probabilities.
        ``flag``: an object whose ``nonfinite`` (a device bool tensor) is OR-ed with "some row's
        scores had NaN / +inf, or no token left" (its total mass is NaN or 0); such a row's id
        is meaningless.
        """
        for w in self.warpers:
            scores = w(None, scores)
        probs = torch.softmax(scores.float(), dim=-1)  # [R, V]
        rows, vocab = probs.shape
        nb = -(-vocab // self.block)
        if nb * self.block != vocab:  # pad with zero mass up to whole blocks
            probs = torch.nn.functional.pad(probs, (0, nb * self.block - vocab))
        blocks = probs.view(rows, nb, self.block)
        cum_blocks = blocks.sum(-1, dtype=torch.float64).cumsum(-1)  # [R, nb]
        if flag is not None:  # NaN mass (a NaN or +inf logit) or none (every logit -inf); no host sync
            bad = ~(cum_blocks[:, -1] > 0).all()
            flag.nonfinite = bad if flag.nonfinite is None else flag.nonfinite | bad
        if uniform is None:
            uniform = torch.rand(rows, 1, dtype=torch.float64, device=probs.device)
        u = uniform.to(torch.float64) * cum_blocks[:, -1:]
        b = torch.searchsorted(cum_blocks, u, right=True).clamp_(max=nb - 1)  # first block ending above u
        before = torch.where(b > 0, cum_blocks.gather(1, (b - 1).clamp(min=0)), torch.zeros_like(u))
        inner = blocks.gather(1, b.unsqueeze(-1).expand(rows, 1, self.block)).squeeze(1).cumsum(-1, dtype=torch.float64)
        # Keep the residual inside [0, block mass): rounding must not step onto a zero-mass tail.
        r = torch.minimum((u - before).clamp_(min=0.0), torch.nextafter(inner[:, -1:], torch.zeros_like(u)))
        j = torch.searchsorted(inner, r, right=True).clamp_(max=self.block - 1)
        return (b * self.block + j).squeeze(1)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        tok = self.draw(scores, flag=self)
        out = torch.full_like(scores, float("-inf"))
        out.scatter_(1, tok.clamp_(max=scores.shape[-1] - 1).unsqueeze(1), 0.0)  # a bad row's index may run past
        return out


class _FiniteGuard(LogitsProcessor):
    """Greedy and ``multinomial`` decoding: flags rows whose logits are NaN or +inf, or all -inf.

    One max per row (NaN propagates through it) decides; ``nonfinite`` is OR-ed on the device
    and read once per segment (see the module doc). Greedy argmax runs on whatever it gets;
    with ``sanitize`` (multinomial) a flagged row's scores become 0 (uniform), so that
    ``generate`` reaches the end of the segment instead of failing inside ``torch.multinomial``.
    """

    def __init__(self, sanitize: bool = False):
        self.nonfinite: torch.Tensor | None = None
        self.sanitize = sanitize

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        bad = ~torch.isfinite(scores.amax(dim=-1, keepdim=True))  # [R, 1]
        self.nonfinite = bad.any() if self.nonfinite is None else self.nonfinite | bad.any()
        return scores.masked_fill(bad, 0.0) if self.sanitize else scores


def _chunks(seq: list[int], size: int) -> Iterable[list[int]]:
    """Consecutive slices of `seq` of length `size` (the last may be shorter)."""
    for i in range(0, len(seq), size):
        yield seq[i : i + size]


class HFEngine(RowPostprocess):
    """Rollout engine running ``model.generate`` on the (shared) training model; see the module doc.

    Args:
        model: a transformers causal LM or a peft wrapper of one (the training model itself).
        tokenizer: its tokenizer (used for the pad/EOS ids and to decode texts and stop strings).
        batch_size: number of sequences (prompts x n) per ``model.generate`` call.
        show_progress: show a tqdm bar over the sub-batches.
        share_prompt: pre-fill each distinct prompt of a sub-batch once and expand its KV cache
            to the prompt's rows (the ``n`` samples), instead of pre-filling every row; the
            sampling distribution is unchanged.
        prune_every: decode in segments of this many tokens and drop the rows that finished
            (EOS or a stop string) between segments, continuing the others from their KV cache;
            ``generate`` alone keeps computing finished rows until the sub-batch's longest row
            ends. 0 = one segment. The sampling distribution is unchanged.
        sampler: ``"inverse_cdf"`` (`_InverseCDFSampler`, one uniform per row) or
            ``"multinomial"`` (transformers' ``do_sample=True``: ``torch.multinomial``, one
            exponential per vocabulary entry). Same law; kept for A/B comparison (bench/decode_speed.py).
        kv_cache: ``"growing"`` (`kvcache.growing_cache`, written in place) or ``"dynamic"``
            (transformers' ``DynamicCache``, re-copied at every token). Same values; kept for A/B.
        reuse_kv: with ``generate(..., sessions=...)``, store each row's KV under its key and encode only
            the tokens after a stored prefix (sessions.py). False: ``sessions`` are accepted and ignored
            (every call encodes its whole prompts), the no-reuse path for A/B benchmarks and tests.
        record_logp: fill ``RolloutBatch.sampler_logp`` [B, T] with each sampled token's log-prob under
            the distribution it was drawn from (after temperature / top-k / top-p; greedy: the
            log-softmax of the logits). False (the default) leaves it None, as the trainer's
            rollout correction keys off it.
    """

    supports_sessions = True  # generate(..., sessions=...) and release(); see the module doc

    def __init__(self, model, tokenizer, batch_size: int = 32, show_progress: bool = False,
                 share_prompt: bool = True, prune_every: int = 64, sampler: str = "inverse_cdf",
                 kv_cache: str = "growing", reuse_kv: bool = True, record_logp: bool = False):
        if sampler not in ("inverse_cdf", "multinomial"):
            raise ValueError(f"sampler must be 'inverse_cdf' or 'multinomial', got {sampler!r}")
        if kv_cache not in ("growing", "dynamic"):
            raise ValueError(f"kv_cache must be 'growing' or 'dynamic', got {kv_cache!r}")
        self.sampler = sampler
        self.kv_cache = kv_cache
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.model = model
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.show_progress = show_progress
        self.share_prompt = share_prompt
        if prune_every < 0:
            raise ValueError(f"prune_every must be >= 0, got {prune_every}")
        self.prune_every = prune_every
        self.reuse_kv = bool(reuse_kv)
        self.record_logp = bool(record_logp)
        self.session_store = SessionStore()  # stored KV by session key (sessions.py)
        self.eos_token_ids, self.pad_token_id = eos_and_pad(_generation_config(model), tokenizer)

    # ------------------------------------------------------------------ interface

    def sync_weights(self, model) -> None:
        """Adopt `model` if it is not the engine's model (otherwise the weights are shared already).

        Either way every stored session cache is dropped: its KV was computed with the weights as they
        were (the shared model's change in place between trainer steps).
        """
        self.session_store.release()
        if model is not self.model:
            self.model = model

    def release(self, sessions: Optional[Iterable[Hashable]] = None) -> None:
        """Free the KV stored under the keys ``sessions`` (unknown keys ignored); None frees every entry."""
        self.session_store.release(sessions)

    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 sessions: Optional[list[Hashable]] = None) -> RolloutBatch:
        """Sample ``params.n`` responses for each tokenized prompt.

        Args:
            prompts: token-id lists (no padding, each non-empty), e.g. from
                ``tokenizer.apply_chat_template(..., add_generation_prompt=True)``.
            params: sampling parameters.
            sessions: one hashable key per output row (``len(prompts) * params.n``, a prompt's rows
                contiguous), e.g. an episode id. A row whose key holds a stored cache reuses the KV of
                its longest common prefix with the row's prompt and encodes only the rest; after the
                call the key holds the row's prompt + response KV (sessions.py). None: nothing is
                reused or stored.

        Returns:
            A `RolloutBatch` with ``len(prompts) * params.n`` rows in prompt order, ``n``
            consecutive rows per prompt (``group`` = prompt index).
        """
        params.validate()
        prompts = [list(map(int, p)) for p in prompts]
        if any(len(p) == 0 for p in prompts):
            raise ValueError("empty prompt: every prompt needs at least one token")
        t0 = time.perf_counter()
        n = params.n
        row_group = [g for g in range(len(prompts)) for _ in range(n)]
        num_rows = len(row_group)
        if sessions is not None and len(sessions) != num_rows:
            raise ValueError(f"sessions has {len(sessions)} keys for {num_rows} rows (len(prompts) * n)")
        keep_kv = sessions is not None and self.reuse_kv
        logps: list[Any] = [None] * num_rows
        # Longest prompts first (stable, so the n copies of a prompt stay adjacent).
        order = sorted(range(num_rows), key=lambda i: -len(prompts[row_group[i]]))
        results: list[Any] = [None] * num_rows

        model = self.model
        device = _model_device(model)
        gen_kwargs = self._generate_kwargs(params)
        was_training = model.training
        rng_devices = []
        if device.type == "cuda":
            rng_devices = [device.index if device.index is not None else torch.cuda.current_device()]
        rng_ctx = torch.random.fork_rng(devices=rng_devices) if params.seed is not None else contextlib.nullcontext()

        from tqdm.auto import tqdm

        chunks = list(_chunks(order, self.batch_size))
        bar = tqdm(total=len(chunks), desc="rollout", disable=not self.show_progress, leave=False)
        try:
            with rng_ctx:
                if params.seed is not None:
                    torch.manual_seed(params.seed)
                model.eval()
                for chunk in chunks:
                    chunk_prompts = [prompts[row_group[i]] for i in chunk]
                    past = [self.session_store.take(sessions[i], p) for i, p in zip(chunk, chunk_prompts)] if keep_kv \
                        else None  # each key's entry leaves the store: the row's new one replaces it
                    rows, lps, kv = self._generate_chunk(chunk_prompts, params, gen_kwargs, device, past)
                    for j, i in enumerate(chunk):
                        results[i] = rows[j]
                        if lps is not None:
                            logps[i] = lps[j][: len(rows[j][0])]
                        if kv is not None:
                            self.session_store.put(sessions[i], kv[j])
                    bar.update(1)
        finally:
            model.train(was_training)
            bar.close()

        batch = self.assemble(prompts, row_group, results, logps if self.record_logp else None)
        batch.gen_time_s = time.perf_counter() - t0
        return batch

    # ------------------------------------------------------------------ internals

    def _generate_kwargs(self, params: SamplingParams) -> dict[str, Any]:
        """Keyword arguments for ``model.generate`` implementing `params` (and nothing else)."""
        kw: dict[str, Any] = dict(
            max_new_tokens=params.max_new_tokens,
            pad_token_id=self.pad_token_id,
            eos_token_id=list(self.eos_token_ids),
            use_cache=True,
            # never lockstep with other ranks: under FSDP the trainer unshards every module before
            # generating (tether.distributed.gathered), so ranks may run different numbers of steps
            synced_gpus=False,
            num_beams=1,
            num_return_sequences=1,
            min_length=0,
            repetition_penalty=1.0,
            no_repeat_ngram_size=0,
        )
        gen_cfg = _generation_config(self.model)
        if params.min_new_tokens:  # transformers bans EOS below this length
            kw["min_new_tokens"] = params.min_new_tokens
        elif getattr(gen_cfg, "min_new_tokens", None):
            kw["min_new_tokens"] = 0
        if self.sampler == "multinomial" and not params.is_greedy:
            kw.update(
                logits_processor=LogitsProcessorList([_FiniteGuard(sanitize=True)]),
                do_sample=True,
                temperature=float(params.temperature),
                top_p=float(params.top_p),
                top_k=int(params.top_k),  # 0 disables (transformers' own default would be 50)
                typical_p=1.0,
                epsilon_cutoff=0.0,
                eta_cutoff=0.0,
            )
            if getattr(gen_cfg, "min_p", None) is not None:
                kw["min_p"] = 0.0
            return kw
        # do_sample=False: transformers then adds none of its warpers (so a checkpoint's min-p,
        # typical-p, epsilon/eta cutoffs or default top-k of 50 cannot apply) and picks the
        # argmax, which is the sampler's one-hot draw when sampling.
        kw.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        if params.is_greedy:
            kw["logits_processor"] = LogitsProcessorList([_FiniteGuard()])
        else:
            kw["logits_processor"] = LogitsProcessorList([_InverseCDFSampler(
                temperature=float(params.temperature), top_k=int(params.top_k), top_p=float(params.top_p))])
        return kw

    def _chunk_inputs(self, chunk_prompts: list[list[int]], params: SamplingParams, device, past) -> tuple:
        """``(ids, mask, cache)`` of one sub-batch: left-padded prompts and an empty cache (shared
        prompts pre-filled), or where rows continue from stored caches (``past``) the layout and
        pre-filled cache of `sessions.layout` / `sessions.prefill`. Empties ``past`` once its KV is
        copied, so that the old entries' memory goes before decoding."""
        cached = [0] * len(chunk_prompts) if past is None else [c for _, c in past]
        ids, mask, past_width = layout(chunk_prompts, cached, self.pad_token_id)
        ids, mask = ids.to(device), mask.to(device)
        # One KV buffer per layer sized for prompt + response, written in place (kvcache.py).
        cache = growing_cache(self.model, reserve=ids.shape[1] + params.max_new_tokens) if self.kv_cache == "growing" \
            else DynamicCache(config=getattr(self.model, "config", None))
        if past_width:
            prefill(cache, past, past_width)
            past.clear()
        elif self.share_prompt and ids.shape[1] > 1:
            shared_prefill(self.model, ids, mask, cache)
        return ids, mask, cache

    @torch.no_grad()
    def _generate_chunk(self, chunk_prompts: list[list[int]], params: SamplingParams, gen_kwargs: dict[str, Any],
                        device, past=None) -> tuple[list[tuple[list[int], str, str]], Optional[list], Optional[list]]:
        """Generate for one sub-batch: ``(response tokens, finish reason, text)`` per row, then per row
        the sampled tokens' log-probs (None without ``record_logp``) and, with ``past`` (one
        ``(stored entry, usable length)`` per row, `SessionStore.take`), the row's new `SessionEntry`."""
        ids, mask, cache = self._chunk_inputs(chunk_prompts, params, device, past)
        width = ids.shape[1]
        eos = torch.tensor(self.eos_token_ids, device=device)
        rows = list(range(len(chunk_prompts)))  # chunk rows still decoding, in the order of `ids`
        resp: list[Any] = [None] * len(rows)
        lps = [[] for _ in rows] if self.record_logp else None
        kv = [None] * len(rows) if past is not None else None
        made, total = 0, params.max_new_tokens
        while True:
            # One segment: decode up to `prune_every` tokens for the rows still running.
            step = total - made if self.prune_every <= 0 else min(self.prune_every, total - made)
            kwargs = dict(gen_kwargs, max_new_tokens=step)
            if "min_new_tokens" in gen_kwargs:  # a caller's floor counts from the first segment
                kwargs["min_new_tokens"] = max(0, min(gen_kwargs["min_new_tokens"] - made, step))
            crit = rec = None
            if params.stop:
                crit = _StopOnStrings(self.tokenizer, list(params.stop), width, self.eos_token_ids)
                kwargs["stopping_criteria"] = StoppingCriteriaList([crit])
            if lps is not None:  # sees the scores before the sampler replaces them
                rec = StepLogp([] if params.is_greedy else _InverseCDFSampler(
                    float(params.temperature), int(params.top_k), float(params.top_p)).warpers)
                kwargs["logits_processor"] = LogitsProcessorList([rec, *gen_kwargs["logits_processor"]])
            kwargs[cache_kwarg(self.model)] = cache
            out = self.model.generate(input_ids=ids, attention_mask=mask, **kwargs)
            if any(bool(p.nonfinite) for p in gen_kwargs["logits_processor"] if p.nonfinite is not None):
                raise GenerationError(NONFINITE_LOGITS)  # one read per segment (see the module doc)
            seqs = out if isinstance(out, torch.Tensor) else out.sequences  # a generation config may ask for a dict
            made_now = seqs.shape[1] - ids.shape[1]
            made += made_now
            new = seqs[:, width:]  # [rows, made] this row's response so far
            if rec is not None:
                for r, lp in zip(rows, rec.finish(seqs[:, -1]).tolist()):
                    lps[r] += lp
            done = torch.isin(new, eos).any(dim=1)
            if crit is not None and crit.done is not None:
                done |= crit.done.to(device)
            last = made >= total or made_now < step or bool(done.all())
            ended = list(range(len(rows))) if last else done.nonzero().flatten().tolist()
            for i in ended:
                resp[rows[i]] = self.finish_row(new[i].cpu().tolist(), params)
            mask = torch.cat([mask, mask.new_ones(len(rows), made_now)], dim=1)  # seqs' mask
            if kv is not None:  # before the rows are dropped from the cache
                toks = [chunk_prompts[rows[i]] + resp[rows[i]][0] for i in ended]
                for i, entry in zip(ended, take_rows(cache, mask, ended, toks)):
                    kv[rows[i]] = entry
            if last:
                return resp, lps, kv
            # Drop the finished rows: generate() would keep decoding them until the longest ends.
            keep = (~done).nonzero().flatten()
            rows = [rows[i] for i in keep.tolist()]
            cache.batch_select_indices(keep)  # generate() decoded into our cache object
            ids, mask = seqs[keep], mask[keep]
