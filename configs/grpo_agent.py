"""GRPO on a multi-turn game with the tiny model, on the 8 local (CPU) devices.

Run:
  python launch/train.py --config configs/grpo_agent.py --workdir /tmp/grpo_agent

The environment `guess_number` hides a whole number in a range ("guess a number from 30 to
44:"); each turn the model answers with a number and the environment says "higher: 38 to
44" or "lower: ...", until the number is found or six guesses are spent. Reward (at the end):
1 when found within the guesses bisection needs (3 for 7 numbers, 4 for 15), 0.5 when found
later, 0 when not found. The model trains on exactly the ids it sampled in each turn (the
feedback's ids are context, masked out of the loss), with GRPO advantages over whole episodes.

A supervised warm-up on episodes of the environment's scripted policy (a number drawn anywhere
in the range left: it uses the feedback but does not bisect) is step 0 of RL; RL then learns to
guess nearer the middle. Held-out reward: one episode per test problem, sampled at temperature
1 (the policy as it plays in training).

Variants (`--config configs/grpo_agent.py:ARG`):
  (none)  the demo, synchronous (rollout, then training, then the next step's rollout).
  async   the same with the asynchronous loop (staleness bound 1, two rollout workers), the
          stages on 4 + 4 devices.
  test    3 RL steps, tiny batches: the smoke test the test suite runs.
"""

from jaxrl.config import default_config, model_config

VARIANTS = (None, "async", "test")


def get_config(arg: str | None = None):
  config = default_config()
  config.seed = 0
  config.model = model_config("tiny")
  config.model.max_seq_len = 256  # six turns of a game fit in about 200 ids
  config.model.dtype = "auto"
  config.rollout.param_dtype = "auto"

  config.task.name = "guess_number"  # the records: (low, high, target)
  config.task.guess_max_low = 85  # numbers of up to 2 digits
  config.task.guess_widths = (7, 15)
  config.env.name = "guess_number"
  config.env.kwargs = {"max_guesses": 6, "late_reward": 0.5, "say_range": True}
  config.env.limits.max_turns = 6
  config.env.limits.step_timeout_s = 10.0
  config.env.max_tokens = 160

  config.placement.mode = "colocated"
  config.loop.mode = "sync"

  config.rollout.prompts_per_step = 8
  config.rollout.group_size = 8
  config.rollout.sampling.temperature = 1.0
  config.rollout.sampling.max_new_tokens = 4  # a turn: a number of up to 2 digits and EOS
  # Shapes sized for a whole trajectory (160 ids): every turn of every length decodes and
  # prefills with one program per row count, instead of one per (rows, table width) that a
  # bucketed engine meets as trajectories grow turn by turn.
  config.rollout.paged.max_tokens = 160
  config.rollout.paged.page_size = 16
  config.rollout.paged.num_pages = 2048
  config.rollout.paged.max_running = 128
  config.rollout.paged.decode_steps = 4  # a turn in one window

  config.warmup.steps = 40
  config.warmup.batch_size = 64
  config.warmup.learning_rate = 3e-3

  config.train.steps = 150
  config.train.advantage = "grpo"
  config.train.updates_per_step = 2
  config.train.micro_batch_size = 32
  config.train.loss.clip_low = 0.2
  config.train.loss.clip_high = 0.28
  config.train.loss.aggregation = "token-mean"
  config.train.optimizer.learning_rate = 5e-4
  config.train.optimizer.warmup_steps = 10
  config.train.optimizer.total_steps = 300

  config.eval.every = 50
  config.eval.num_prompts = 180
  config.eval.temperature = 1.0
  config.checkpoint.every = 50

  if arg == "async":
    # Rollout and training on devices of their own (4 + 4): simulated CPU devices shared by
    # concurrent programs of both stages can stall each other's collectives.
    config.placement.mode = "disaggregated"
    config.placement.rollout_devices = 4
    config.placement.train_devices = 4
    config.loop.mode = "async"
    config.loop.max_staleness = 1
    config.loop.rollout_workers = 2
  elif arg == "test":
    config.warmup.steps = 2
    config.rollout.prompts_per_step = 4
    config.rollout.group_size = 4
    config.train.steps = 3
    config.train.micro_batch_size = 8
    config.eval.every = 3
    config.eval.num_prompts = 8
    config.checkpoint.every = 0
  elif arg:
    raise ValueError(f"Unknown variant {arg!r} of grpo_agent; use async or test.")
  return config
