"""Supervised fine-tuning of the policy (``tether sft``, docs/sft.md): conversations or prompt /
completion pairs, the loss on assistant tokens only, before RL with ``tether train model.name=RUN``.

    data.py     reading and checking JSONL rows; encoding them with an exact per-token loss mask
    batches.py  which rows form a batch (padded, length-grouped, packed) and their tensors
    loop.py     SFTTrainer (step, validation, checkpoints, stop), sft, resume_sft
    demos.py    cold-start demonstrations through the real environments (``tether demos``)
"""

from .loop import SFTTrainer, resume_sft, resume_sft_config, sft

__all__ = ["SFTTrainer", "resume_sft", "resume_sft_config", "sft"]
