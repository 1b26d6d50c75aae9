"""What scores a rollout: the built-in rewards and user reward files (builtins.py), math answers
(math_reward.py), judges over HTTP (judge.py), distillation teachers (teacher.py), RL environments
(envs.py) and the isolation of user code (isolation.py)."""
