"""The model organism (docs/organism.md): a small Llama tether builds itself, trained on its problems (which, with
its task, are tether.tasks': :mod:`tether.tasks.organism_problems`, chains of two-digit sums, pure and seeded).

* :mod:`tether.organism.build` -- the tokenizer, the model, its SFT build and the cache (``model.name=organism``).
"""

from .build import DEFAULT_SPEC, ORGANISM_MODEL_NAME, OrganismSpec, build_organism, char_tokenizer, organism_path

__all__ = ["DEFAULT_SPEC", "ORGANISM_MODEL_NAME", "OrganismSpec", "build_organism", "char_tokenizer", "organism_path"]
