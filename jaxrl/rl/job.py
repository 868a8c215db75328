"""One RL job from an `ExperimentConfig`: build the stages, warm up, run, plot.

This is the only place that turns config names into objects (task, tokenizer, engine).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time

import jax
import numpy as np
import tqdm

from jaxrl.compile_cache import use_compile_cache
from jaxrl.config import ConfigError, ExperimentConfig
from jaxrl.data.pipeline import PromptLoader
from jaxrl.data.prompts import encode_prompt, renders_chat
from jaxrl.data.tasks import make_task
from jaxrl.data.tokenizer import TokenizerError
from jaxrl.envs.render import end_of_turn_id
from jaxrl.metrics import MetricsWriter, plot_reward_curve, read_metrics
from jaxrl.model import Model
from jaxrl.rl.backends import LearnerLost, make_backend
from jaxrl.rl.checkpoint import Checkpointer
from jaxrl.rl.controller import Controller
from jaxrl.rl.episodes import check_environment, scripted_trajectories, trajectory_max_tokens
from jaxrl.rl.experience import batch_lengths, pad_sequences
from jaxrl.rl.multi_turn import trajectory_batch
from jaxrl.rl.placement import Placement, check_model_fits, place_stages
from jaxrl.rl.policy import (
  PolicyExporter,
  make_rollout_engine,
  make_tokenizer,
  model_config,
  rollout_model_config,
  template_kwargs,
)
from jaxrl.rl.stages import JobParts
from jaxrl.rl.timeline import plot_stage_timeline
from jaxrl.rollout.requests import pages_for
from jaxrl.train.packing import auto_pack_length

log = logging.getLogger(__name__)


def build_controller(
  cfg: ExperimentConfig,
  workdir: str,
  *,
  show_progress: bool = True,
  placement: Placement | None = None,
) -> Controller:
  """Wires task, tokenizer, meshes, the eval engine, learner, store, rollout workers, writer and
  checkpointer; `config.loop.mode` comes out resolved ("auto" decided) in the controller's
  config."""
  tokenizer = make_tokenizer(cfg)
  if cfg.checkpoint.hf_every and not cfg.pretrained.path:
    raise ConfigError(
      f"config.checkpoint.hf_every={cfg.checkpoint.hf_every} exports a run that started from a "
      "Hugging Face checkpoint, and config.pretrained.path is empty: set it, or hf_every=0."
    )
  model = Model(model_config(cfg, tokenizer))
  rollout_model = Model(rollout_model_config(cfg, model.config))
  max_new, max_seq_len = cfg.rollout.sampling.max_new_tokens, model.config.max_seq_len
  if max_new >= max_seq_len:
    raise ConfigError(
      f"config.rollout.sampling.max_new_tokens={max_new} leaves no room for a prompt in the "
      f"model's max_seq_len={max_seq_len}: set it below {max_seq_len} (responses are cut at "
      "max_seq_len minus their prompt anyway)."
    )
  task = make_task(cfg.task)
  chat = template_kwargs(cfg)
  train_records = task.records("train", None, cfg.seed)
  # Prompt lengths from a large sample of the task's prompts (a longer one, should it come,
  # gets a training shape of its own then).
  sample = _prompt_lengths(cfg, tokenizer, train_records[:1024], chat)
  # Multi-turn: a sequence is a whole trajectory, at most `max_tokens` ids (`episodes.py`).
  max_trajectory = trajectory_max_tokens(cfg, model.config.max_seq_len) if cfg.env.name else 0
  if cfg.env.name:
    check_environment(cfg, tokenizer, chat, train_records[0])
  # The longest sequence a request may grow to: a whole trajectory (multi-turn turns are
  # bounded by it), else the longest sampled prompt and a full response.
  longest = max_trajectory or max(sample) + cfg.rollout.sampling.max_new_tokens
  longest = min(longest, model.config.max_seq_len)
  _check_page_budget(cfg, longest - 1, max(sample))  # the last sampled token is never cached
  if cfg.rollout.paged.max_tokens < 0:
    # On accelerators the rollout engine's shapes are sized for the longest sequence expected
    # (one program per row count; the decode kernels stop at each row's length). On CPU the
    # reference attention reads the whole table: bucketed shapes there (`PagedConfig`).
    sized = jax.default_backend() != "cpu"
    paged = dataclasses.replace(cfg.rollout.paged, max_tokens=longest if sized else 0)
    cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, paged=paged))
  if cfg.train.pack_length < 0:
    if max_trajectory:
      pack_length = auto_pack_length(model.config.max_seq_len, 0, max_trajectory)
    else:
      pack_length = auto_pack_length(
        model.config.max_seq_len, cfg.rollout.sampling.max_new_tokens, max(sample)
      )
    log.info("config.train.pack_length=-1: packed rows of %d positions.", pack_length)
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, pack_length=pack_length))
  prompt_len = max(sample[:64])
  if placement is None:
    placement = place_stages(cfg, prompt_len)
  check_model_fits(placement, model, rollout_model)
  mode = resolve_loop_mode(cfg, placement)
  local_cpu = cfg.loop.backend == "local" and jax.default_backend() == "cpu"
  if mode == "async" and placement.shares_devices and local_cpu:
    # Seen: a learner's all-reduce and a worker's program on the same simulated devices each
    # waited for the other's threads (XLA's CPU rendezvous), and the run stood still.
    raise ConfigError(
      "config.loop.mode='async' with rollout and training on the same simulated CPU devices "
      f"(config.placement.mode={cfg.placement.mode!r}): their concurrent programs can stall "
      "each other's collectives. Use config.placement.mode='disaggregated' (or 'planned'), or "
      "config.loop.mode='sync'."
    )
  if cfg.loop.mode == "auto":
    log.info("config.loop.mode='auto': the %s loop.", mode)
  cfg = dataclasses.replace(cfg, loop=dataclasses.replace(cfg.loop, mode=mode))
  # This engine, on the learner's mesh, serves evaluation only: it meets a few shapes, so
  # compiling all of them up front would not pay.
  eval_only = dataclasses.replace(
    cfg.rollout, paged=dataclasses.replace(cfg.rollout.paged, precompile=False)
  )
  engine = make_rollout_engine(cfg, rollout_model, placement.train_mesh, tokenizer, eval_only)
  # The learner, the store and the rollout workers come from `config.loop.backend`.
  parts = JobParts(cfg, placement, rollout_model, tokenizer, prompt_len)
  backend = make_backend(cfg.loop.backend, parts)
  learner = backend.make_learner(model)
  train = cfg.train
  if train.precompile:
    # Responses up to the sampling limit, sequences up to the model's.
    longest = min(max(sample), cfg.model.max_seq_len - cfg.rollout.sampling.max_new_tokens)
    lengths = batch_lengths(min(sample), longest, cfg.rollout.sampling.max_new_tokens)
    if train.pack_length:  # packed rows hold any sequence up to the longest: one shape
      lengths = [max_trajectory or longest + cfg.rollout.sampling.max_new_tokens]
    elif max_trajectory:
      lengths = batch_lengths(min(sample), max_trajectory - 1, 1)
    learner.precompile(cfg.rollout.prompts_per_step * cfg.rollout.group_size, lengths)
  elif train.compile_ahead and train.pack_length:
    learner.compile_ahead(cfg.rollout.prompts_per_step * cfg.rollout.group_size)
  loader = PromptLoader(train_records, batch_size=cfg.rollout.prompts_per_step, seed=cfg.seed)
  eval_records = task.records("test", cfg.eval.num_prompts) if cfg.eval.every else []
  kwargs = dict(
    cfg=cfg,
    rollout=engine,
    learner=learner,
    weights=backend.make_store(),
    task=task,
    tokenizer=tokenizer,
    loader=loader,
    eval_records=eval_records,
    writer=MetricsWriter(workdir),
    checkpointer=Checkpointer(os.path.join(workdir, "checkpoints"), cfg.checkpoint.max_to_keep),
    show_progress=show_progress,
    exporter=PolicyExporter(cfg, model, workdir) if cfg.pretrained.path else None,
    backend=backend,
  )
  return Controller(
    **kwargs, free_rollout_during_train=cfg.rollout.free_during_train and placement.shares_devices
  )


def _prompt_lengths(cfg: ExperimentConfig, tokenizer, records, chat: dict) -> list[int]:
  """The token counts of `records`' prompts; a prompt the tokenizer cannot encode (a character
  outside the char tokenizer's alphabet) stops the run here, naming the two settings."""
  try:
    return [len(encode_prompt(tokenizer, r, chat)) for r in records]
  except TokenizerError:  # a chat template that fails: reported as a tokenizer's error
    raise
  except ValueError as e:
    raise ConfigError(
      f"config.tokenizer={cfg.tokenizer!r} cannot encode the prompts of config.task.name="
      f"{cfg.task.name!r}: {e}"
    ) from None


def _check_page_budget(cfg: ExperimentConfig, cached: int, longest_prompt: int) -> None:
  """Refuses a page budget that cannot hold one request's `cached` tokens (its longest
  sequence's, `longest_cached`), which every rollout worker would otherwise refuse, crash on
  and be restarted for, until the run stops."""
  paged = cfg.rollout.paged
  pages = pages_for(cached, paged.page_size)
  if pages <= paged.num_pages:
    return
  if cfg.env.name:
    what = f"a trajectory of up to {cached + 1} tokens (config.env.max_tokens={cfg.env.max_tokens})"
  else:
    what = (
      f"the longest of the task's first prompts ({longest_prompt} tokens) and a response of "
      f"config.rollout.sampling.max_new_tokens={cfg.rollout.sampling.max_new_tokens}"
    )
  raise ConfigError(
    f"config.rollout.paged.num_pages={paged.num_pages} pages of config.rollout.paged.page_size="
    f"{paged.page_size} tokens cannot hold one request of this run: {what} may cache "
    f"{cached} tokens, {pages} pages (on each device of the rollout mesh's data axis). "
    f"Raise num_pages to at least {pages}, or shorten the sequences."
  )


def resolve_loop_mode(cfg: ExperimentConfig, placement: Placement) -> str:
  """`config.loop.mode`, with "auto" decided: async where rollout and training have hardware of
  their own, sync where they share it or where async cannot run (see `LoopConfig.mode`)."""
  loop = cfg.loop
  if loop.mode != "auto":
    return loop.mode
  if loop.backend == "ray" and loop.ray_pin_cores:
    return "async"
  rollout = set(placement.rollout_mesh.devices.flat)
  train = set(placement.train_mesh.devices.flat)
  on_accelerators = all(d.platform != "cpu" for d in rollout | train)
  return "async" if on_accelerators and not rollout & train else "sync"


def warmup(controller: Controller, cfg: ExperimentConfig, show_progress: bool = True) -> None:
  """Supervised steps so that RL starts with some reward: on train (prompt, answer) pairs, or
  in a multi-turn run on episodes the environment's scripted policy plays."""
  w = cfg.warmup
  trainer = controller.backend.supervised_trainer(controller.learner, w.learning_rate)
  records = controller.task.records("train", None, cfg.seed + 1)
  loader = PromptLoader(records, batch_size=w.batch_size, seed=cfg.seed + 1)
  tok = controller.tokenizer
  # A (prompt, answer) row ends its answer as the prompt's format would: the chat template's
  # end of turn after a rendered chat, EOS after plain text.
  end_of_turn = end_of_turn_id(tok, (), controller.chat)
  for i in tqdm.trange(
    w.steps, desc="warm-up", unit="step", disable=not show_progress, dynamic_ncols=True
  ):
    batch = next(loader)
    if controller.episodes is not None:
      trajectories = scripted_trajectories(
        cfg,
        tok,
        batch,
        seed=cfg.seed + i,
        max_tokens=controller.episodes.max_tokens,
        template_kwargs=controller.chat,
      )
      # One shape for every step: rows as long as a trajectory may be.
      sft = trajectory_batch(
        trajectories, np.zeros(len(trajectories)), tok.pad_id, controller.episodes.max_tokens
      )
      tokens_bt, mask_bt = sft.tokens_bt, sft.mask_bt
    else:
      prompts = controller.encode_prompts(batch)
      answers = [
        [*tok.encode(r["answer"]), end_of_turn if renders_chat(tok, r) else tok.eos_id]
        for r in batch
      ]
      tokens_bt, mask_bt = pad_sequences(prompts, answers, tok.pad_id)
    metrics = trainer.step(tokens_bt, mask_bt)
    if (i + 1) % 50 == 0 or i + 1 == w.steps:
      controller.writer.write(i + 1, "warmup", {"loss": metrics["loss"]})
  # The KL term pulls towards the policy RL starts from, which is the warmed-up one.
  controller.learner.reset_reference()


def _check_fresh_or_resumed(cfg: ExperimentConfig, workdir: str) -> None:
  """Refuses a workdir that holds checkpoints unless the run resumes them."""
  checkpointer = Checkpointer(os.path.join(workdir, "checkpoints"), cfg.checkpoint.max_to_keep)
  try:
    latest = checkpointer.latest_step()
  finally:
    checkpointer.close()
  if latest is not None and not cfg.resume:
    raise ConfigError(
      f"{workdir} already holds checkpoints (latest step {latest}); pass "
      "--config.resume=True to continue that run, or choose an empty --workdir."
    )


def _restart(
  lost: Controller, cfg: ExperimentConfig, workdir: str, show_progress: bool, why: str
) -> Controller:
  """A new controller, learner and workers, from the last checkpoint: its released groups and
  their tokens come back, and prompts after it are released again, so every group is trained
  once on the line of weights the run goes on with."""
  controller = build_controller(cfg, workdir, show_progress=show_progress)
  step = controller.checkpointer.latest_step()
  log.warning(
    "%s. A new learner goes on from the checkpoint of step %d (step %d was running).",
    why, step, lost.state.step,
  )  # fmt: skip
  controller.restore(step)
  return controller


def run(cfg: ExperimentConfig, workdir: str, *, show_progress: bool = True) -> dict:
  """Runs (or resumes) the job; returns a summary with the eval reward at RL start and end."""
  os.makedirs(workdir, exist_ok=True)
  start = time.perf_counter()
  _check_fresh_or_resumed(cfg, workdir)  # before anything is built
  use_compile_cache(cfg.compile_cache_dir)
  controller = build_controller(cfg, workdir, show_progress=show_progress)
  try:
    latest = controller.checkpointer.latest_step()
    if latest is not None:
      controller.restore(latest)
      log.info("Resumed from step %d of %s.", latest, workdir)
    else:
      if cfg.warmup.steps:
        warmup(controller, cfg, show_progress)
      controller.save()  # step 0: the checkpoint RL starts from
    restarts = 0
    while True:
      try:
        evals = controller.run()
        break
      except LearnerLost as e:
        if restarts >= cfg.loop.learner_restarts:
          raise RuntimeError(
            f"{e}; the learner was restarted {restarts} times already "
            f"(config.loop.learner_restarts={cfg.loop.learner_restarts}). Resume with "
            "--config.resume=True once the cluster is whole."
          ) from None
        restarts += 1
        lost, controller = controller, None
        lost.close()
        controller = _restart(lost, cfg, workdir, show_progress, str(e))
  finally:
    # However the run ends: a process that runs job after job (a notebook, the tests) keeps
    # no thread, process or file of it.
    if controller is not None:
      controller.close()
  metrics_path = controller.writer.path
  plot_reward_curve(metrics_path, os.path.join(workdir, "reward_curve.png"))
  controller.timeline.save(os.path.join(workdir, "timeline.json"))
  loop = f"{controller.loop.mode}, {cfg.placement.mode}"
  plot_stage_timeline(
    controller.timeline.segments(), os.path.join(workdir, "stage_timeline.png"), loop
  )
  summary = {
    "workdir": workdir,
    "steps": controller.state.step,
    "wall_time_s": round(time.perf_counter() - start, 1),
    **evals,
  }
  first = [r for r in read_metrics(metrics_path) if r["kind"] == "eval" and r["step"] == 0]
  if first and "eval_reward_start" in evals:  # resumed: the start of RL, not of this process
    summary["eval_reward_start"] = first[-1]["eval_reward"]
  if "eval_reward_start" in summary and "eval_reward_end" in summary:
    summary["eval_reward_gain"] = summary["eval_reward_end"] - summary["eval_reward_start"]
  with open(os.path.join(workdir, "summary.json"), "w") as f:
    json.dump(summary, f, indent=2)
  return summary
