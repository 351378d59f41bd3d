"""verifiers' own reasoning-gym integration (``ReasoningGymEnv``, a SingleTurnEnv) for tether's tests
(tests/test_verifiers.py): loaded as ``verifiers:tether_vf_rg``, offline."""

import verifiers as vf


def load_environment(gym: str = "basic_arithmetic", num_train_examples: int = 20, num_eval_examples: int = 5,
                     seed: int = 0):
    return vf.ReasoningGymEnv(gym=gym, num_train_examples=num_train_examples, num_eval_examples=num_eval_examples,
                              seed=seed)
