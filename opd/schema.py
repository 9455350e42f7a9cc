"""The recipe's schema: one structured config for every run, as typed dataclasses.

A recipe is a YAML file that binds to :class:`OPDConfig` (:func:`opd.config.load_config` loads and
validates it). A field's type says what it takes: a choice among strings is a ``Literal`` of them,
checked when the recipe binds, so the choices live with the field; the comment after each field
says what it means. Every layer may read this module: it imports nothing of opd's.

Example:
    >>> cfg = OmegaConf.structured(OPDConfig)  # doctest: +SKIP
    >>> cfg.supervision.scoring  # doctest: +SKIP
    'sampled'
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple, Optional, get_args

from omegaconf import MISSING


class ConfigError(ValueError):
    """A recipe or override that cannot run; the message says which key and how to fix it."""


TeacherView = Literal["state_grounded", "full"]
ScoringMode = Literal["sampled", "topk", "full", "hidden"]
SCORING_MODES: tuple[str, ...] = get_args(ScoringMode)


@dataclass
class TinyArchConfig:
    """Shape of a tiny Qwen3 model built from scratch (tests and the quickstart)."""

    hidden_size: int = 128  # model width
    num_layers: int = 2  # transformer blocks
    num_heads: int = 2  # attention heads; head_dim is fixed at 64 (vLLM's CPU attention needs it)
    intermediate_size: int = 384  # MLP width
    vocab_size: int = 0  # embedding rows: 0 = the tokenizer's; more pads them, as Qwen3's 151,936 pad its 151,669 tokens


@dataclass
class BootstrapConfig:
    """Build a tiny model by SFT on a scripted policy's trajectories, cached by content hash.

    The quickstart uses this to make its own teacher (SFT on the environment's expert) and its
    student (SFT on uniformly random valid actions: it knows the format but not the task).
    """

    policy: Literal["expert", "random_valid"] = "expert"  # whose trajectories the model imitates
    arch: TinyArchConfig = field(default_factory=TinyArchConfig)
    n_episodes: int = 2000  # scripted episodes on the train split
    explore_prob: float = 0.0  # chance a turn plays a random valid move (not trained on), so the
    # model also sees, and learns to recover from, states off the scripted policy's path
    sft_steps: int = 1500  # optimizer steps
    batch_size: int = 32  # sequences per SFT step
    learning_rate: float = 2e-3  # AdamW learning rate (cosine decay)
    tokenizer_vocab_size: int = 320  # byte-level BPE trained on the environment's text
    corpus_episodes: int = 300  # random episodes whose text trains that BPE
    tokenizer: str = ""  # "": that trained BPE; "mix": the BPE trained on the text of the whole env.mix (one for
    # the student and every teacher of a mixed run); "smollm2": SmolLM2's own (offline); or a tokenizer directory
    init: str = ""  # "": a tiny Qwen3 shaped by arch, from scratch; "smollm2": fine-tune SmolLM2-135M-Instruct
    # (needs tokenizer: smollm2); or a model directory whose tokenizer is ``tokenizer``
    init_layers: int = 0  # with init: keep the first N transformer blocks (0: all), a smaller model that starts pretrained
    think: Literal["", "plan"] = ""  # "": the response is the action; "plan": a <think> block (state and plan) before it
    action_only_prob: float = 0.0  # share of turns also trained in ActFirst's action-only prompts
    history: Literal["full", "state_grounded", "both"] = "full"  # what past turns show in the SFT rows: full (their whole response) |
    # state_grounded (their action only; one packed row per episode, each response a branch):
    # the view a state-grounded teacher scores in | both: each episode in both layouts (a teacher
    # at home in either view, to compare the views with one teacher)
    hint_prob: float = 0.0  # share of turns also trained with PivotOPD's hint line (the self-teacher reads hints)
    dagger_episodes: int = 0  # with init: also this many episodes played by the init model on the next train
    # games, every turn labelled with the env's expert action in the state the model reached (DAgger)
    dagger_temperature: float = 1.0  # the init model's sampling temperature in those episodes (0: greedy)
    seed: Optional[int] = None  # model seed; None: run.seed (teacher) / run.seed + 1 (student)
    cache_dir: str = "~/.cache/opd/bootstrap"  # where built models are kept between runs
    shipped: bool = True  # use the copy shipped with opd where there is one (the CPU recipes' models,
    # opd/bootstrap/shipped_models: the same weights on every machine); false: build it here


@dataclass
class LoraConfig:
    """LoRA adapters on the student (docs/lora.md): only they train; rank 0 trains every weight."""

    rank: int = 0  # adapter rank r (e.g. 8 to 128); 0: no adapters, a full fine-tune
    alpha: float = 32.0  # the adapters' output is scaled by alpha / rank
    dropout: float = 0.0  # dropout on the adapters' input while training
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])  # the linear layers that get
    # adapters, by last name (q_proj, v_proj...); all-linear: every one but the output head


@dataclass
class ServerConfig:
    """A teacher served over HTTP (``teacher.engine: server``): an OpenAI-compatible completions
    endpoint that returns prompt logprobs, as ``vllm serve`` does (docs/served_teacher.md)."""

    urls: list[str] = field(default_factory=list)  # base URLs of the server's replicas (http://host:port), used round-robin
    model: str = ""  # the served model's name (vllm serve --served-model-name, else the path it was started with)
    api_key_env: str = ""  # environment variable holding the API key (never the key itself); "": none sent
    timeout_s: float = 120.0  # one HTTP request slower than this has failed (and is retried)
    connect_timeout_s: float = 5.0  # the start's checks: a server that does not answer within this is down
    retries: int = 3  # failed attempts of a request (on the other replicas first) before the run stops
    in_flight: int = 4  # HTTP requests at once
    prompts_per_request: int = 8  # sequences batched in one request
    request: Literal["episode", "turn"] = "episode"  # episode: a trajectory's turns share sequences where they can
    # (never more tokens) | turn: one sequence per turn
    replica_tolerance: float = 0.02  # largest logprob difference between replicas on the start's probe


@dataclass
class ModelConfig:
    """A causal LM named by hub id or local directory, or built by ``bootstrap``."""

    path: str = ""  # hub id or local dir ("smollm2": SmolLM2-135M-Instruct, offline); empty when ``bootstrap`` builds the model
    engine: Literal["hf", "vllm", "server", "auto"] = "auto"  # auto: vllm when this role's actor has a GPU, hf on
    # CPU; server (teacher only): a model served over HTTP, see ``server``
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"  # weights and compute
    trust_remote_code: bool = False  # run code shipped with the model; off unless you trust it
    allow_download: bool = False  # let a hub id that is not in the local cache be downloaded
    prefix_cache_mb: float = 256.0  # hf engine: KV of recent prompts reused by prompts extending them (0: off)
    tensor_parallel_size: int = 1  # vllm engine: GPUs one replica's model is split over (its actor's
    # resources.<role>_gpus must hold them)
    bootstrap: Optional[BootstrapConfig] = None  # build a tiny model instead of loading one
    lora: LoraConfig = field(default_factory=LoraConfig)  # student only: train LoRA adapters, not every weight
    server: ServerConfig = field(default_factory=ServerConfig)  # teacher.engine: server: where it is served; ``path``
    # then names its tokenizer only ("": the student's)


@dataclass
class MixEnvConfig:
    """One environment of a mixed run (``env.mix``, docs/teachers.md): its tasks are named
    ``NAME::TASK`` and its episodes are graded by the teacher it names."""

    name: str = MISSING  # what metrics, the console and the report call it (letters, digits, _ and -)
    id: str = MISSING  # registered gymnasium id, e.g. opd/FrozenLakeText-v0
    kwargs: dict[str, Any] = field(default_factory=dict)  # its constructor keyword arguments
    module: str = ""  # a module to import first, registering an env that lives in your own package
    share: float = 1.0  # its weight in every step's episodes (the shares are normalised over the mix)
    train_split: str = ""  # its split that env.train_split means here ("": the same name)
    eval_split: str = ""  # its split that env.eval_split means here ("": the same name)
    teacher: str = "teacher"  # who grades its episodes: a key of `teachers`, or teacher (the recipe's teacher section)


@dataclass
class TeacherConfig(ModelConfig):
    """A named teacher of ``teachers`` (docs/teachers.md): a model as ``teacher`` is, with its
    own actors; ``env.mix`` routes environments to it by name."""

    replicas: int = 0  # its actors (scoring shared among them); 0: resources.teacher_replicas
    cpus: float = -1.0  # CPU share of each of its actors; -1: resources.teacher_cpus
    gpus: float = -1.0  # GPUs of each of its actors; -1: resources.teacher_gpus


@dataclass
class EnvConfig:
    """The environment, by registered id, and which task splits train and evaluate."""

    id: str = MISSING  # registered gymnasium id, e.g. opd/FrozenLakeText-v0; left out with `mix`
    mix: list[MixEnvConfig] = field(default_factory=list)  # several environments in one run (each its share of
    # every step's episodes, its own teacher); the keys below (splits, isolation, limits) hold for each
    kwargs: dict[str, Any] = field(default_factory=dict)  # constructor keyword arguments
    train_split: str = "train"  # tasks the student trains on
    eval_split: str = "eval"  # held-out tasks for evaluation
    module: str = ""  # a module to import first, registering an env that lives in your own package
    isolation: Literal["subprocess", "inprocess"] = "subprocess"  # subprocess: each episode's env in a child process
    timeout_s: float = 60.0  # a reset or step slower than this counts as hung: the episode is marked
    memory_limit_mb: float = 4096.0  # subprocess: an env process's data-memory cap (RLIMIT_DATA); 0: none
    cpu_time_limit_s: float = 60.0  # subprocess: CPU seconds one reset or step may use; 0: none


@dataclass
class RolloutConfig:
    """How the student plays: episodes per step and sampling."""

    episodes_per_step: int = 32  # episodes collected per training step
    max_new_tokens: int = 16  # response budget per turn
    temperature: float = 1.0  # sampling temperature; the trainer's policy is softmax(logits / temperature)
    group_size: int = 1  # episodes per task in a step (GRPO groups for ppo_clip); divides episodes_per_step
    max_context_tokens: int = 2048  # an episode whose context would exceed this is truncated
    system_prompt: str = ""  # optional system message before the task


@dataclass
class SupervisionConfig:
    """What the teacher sees and what it returns."""

    teacher_view: TeacherView = "state_grounded"  # state_grounded: task, executed actions, observations | full: the student's own history
    scoring: ScoringMode = "sampled"  # sampled (teacher logprob of each student token) | topk | full (whole
    # vocabulary) | hidden (full's distribution, sent as the teacher's final hidden states; its head once per run)
    top_k: int = 20  # ids per position for scoring: topk
    cross_tokenizer: bool = False  # teacher tokenizer differs: re-tokenise text, align spans (sampled only)
    score_batch_size: int = 16  # trajectories per teacher forward
    score_batch_tokens: int = 4096  # cap on a teacher forward's padded tokens (HF engine); 0: no cap


@dataclass
class ActFirstConfig:
    """ActFirst-OPD (``algorithm: actfirst_opd``): act by inverse dynamics along a reference, then
    generate the full think-then-act responses off the critical path."""

    inverse_dynamics: bool = True  # false: the "w/o ID" ablation, fast actions with no reference
    reference_source: Literal["expert", "teacher", "dataset"] = "expert"  # the env's expert | the teacher's rollouts | a dataset
    reference_dataset: str = ""  # reference_source: dataset: a user's dataset (see docs/actfirst.md)
    references_dir: str = ""  # where built references live; "": under bootstrap's cache, keyed by content
    keep_failed_references: bool = False  # keep references that did not succeed
    action_max_new_tokens: int = 8  # token budget of a fast (action-only) turn
    transition_check: Literal["exact", "env"] = "exact"  # exact (normalised text) | env (the environment's own comparator)
    decode_during_env_steps: bool = True  # the stream decodes the full responses while the environments
    # step (env.isolation: subprocess); false: it waits, and a rollout is bitwise reproducible for a seed


@dataclass
class PivotConfig:
    """PivotOPD (``algorithm: pivot_opd``): find the pivotal mistake in failed rollouts, prevent it
    (reverse KL) and teach recovery (forward KL to a hinted self-teacher), in one PPO update.
    The terms and their weights (lambda_prev, lambda_rec) are the recipe's ``losses``:
    ``ppo_clip``, ``pivot_preventive`` and ``pivot_recovery``."""

    finder: Literal["judge", "teacher_logprob", "kl", "expert"] = "teacher_logprob"  # judge: the teacher reads the transcript
    judge_fallback: Literal["teacher_logprob", "kl", "expert"] = "teacher_logprob"  # heuristic used when the judge's answer does not parse
    hint_source: Literal["teacher", "expert"] = "teacher"  # heuristic finders: gold/recovery actions from the teacher's greedy play | the expert
    recovery_turns: int = 2  # k: turns after the pivot trained toward the self-teacher
    judge_max_new_tokens: int = 96  # token budget of the teacher's judgement
    hint_top_k: int = 20  # self-teacher distribution kept per position (top-k + tail)


@dataclass
class CurriculumConfig:
    """Which states the student learns in (docs/curricula.md): TCOD's turn-depth curriculum
    (arXiv 2604.24005), starts from replayed prefixes of reference episodes (ReOPD), and turns
    played by the teacher inside the student's episodes (Guided-OPD)."""

    depth: Literal["off", "forward", "backward"] = "off"  # off: every turn trains | forward: the first d
    # turns are played and trained | backward: every turn is played, the last d train
    start_depth: int = 1  # d at step 1
    full_depth_step: int = 0  # the step from which d is the whole horizon (the schedule's end)
    horizon: int = 0  # the whole horizon in turns; 0: the env's max_turns
    schedule: Literal["linear", "step"] = "linear"  # linear: d grows evenly from step 1 to full_depth_step |
    # step: in `stages` equal jumps
    stages: int = 4  # schedule: step: how many jumps
    prefix_source: Literal["off", "expert", "teacher", "dataset"] = "off"  # start episodes from a replayed prefix of
    # a reference episode (ReOPD): the env's expert's | the teacher's | a dataset's (actfirst.reference_dataset);
    # built and stored as ActFirst's references (docs/actfirst.md)
    prefix_share: float = 1.0  # the share of each step's episodes that start from a prefix
    prefix_fraction: float = 0.5  # at step 1 a prefix is up to this share of its reference's turns (drawn evenly)
    prefix_end_step: int = 0  # the step from which no episode starts from a prefix (the longest prefix falls
    # linearly from prefix_fraction at step 1 to none there)
    guide_share: float = 0.0  # the share of the student's turns the teacher plays at step 1 (Guided-OPD), as context
    guide_end_step: int = 0  # the step from which the student plays every turn (the share falls linearly to it)


@dataclass
class LossConfig:
    """One term of the loss: a registered name or a dotted path to ``fn(batch, cfg)``."""

    name: str = MISSING  # e.g. reverse_kl, or my_pkg.my_module.my_loss
    weight: float = 1.0  # multiplier in the weighted sum
    args: dict[str, Any] = field(default_factory=dict)  # passed to the loss as ``cfg``


@dataclass
class TrainerConfig:
    """The student trainer: DeepSpeed, or plain PyTorch on one rank."""

    engine: Literal["deepspeed", "torch"] = "deepspeed"  # torch: plain PyTorch, one rank, no DeepSpeed needed
    learning_rate: float = 1e-4  # AdamW learning rate
    warmup_steps: int = 10  # linear learning-rate warm-up; Adam's first steps are full-size otherwise
    lr_schedule: Literal["constant", "cosine"] = "constant"  # cosine: to min_lr_ratio at run.total_steps
    min_lr_ratio: float = 0.1  # final learning rate / peak, for the cosine schedule
    weight_decay: float = 0.0  # AdamW weight decay
    adam_beta1: float = 0.9  # AdamW beta1
    adam_beta2: float = 0.999  # AdamW beta2
    grad_clip_norm: float = 1.0  # global gradient-norm clip
    zero_stage: Literal[0, 1, 2, 3] = 0  # DeepSpeed ZeRO stage (engine: torch has one rank: no effect)
    micro_batch_size: int = 32  # sequences per forward/backward; must divide episodes_per_step
    micro_batch_tokens: int = 4096  # cap on a micro-batch's padded tokens (rows x its longest row); 0: no cap
    max_nonfinite_steps: int = 3  # consecutive steps with a NaN/inf loss before the run stops
    vocab_chunk_tokens: int = 0  # scored tokens whose [chunk, V] log-softmax is held at once (the exact losses
    # and the student's logprobs go chunk by chunk, recomputed in the backward pass); 0: auto (128 MiB of
    # float32 rows: 2**25 // V tokens); -1: all at once


@dataclass
class RunConfig:
    """Length, seeds, evaluation and checkpoint cadence, where the run directory lives."""

    total_steps: int = 100  # training steps
    seed: int = 0  # seeds tasks, sampling and model init
    output_dir: str = "runs/default"  # run directory
    eval_every_steps: int = 0  # 0: evaluate only before and after training
    eval_episodes: int = 100  # held-out episodes per evaluation (greedy)
    eval_history: Literal["auto", "full", "state_grounded"] = "auto"  # what past turns show: full (whole responses) |
    # state_grounded (actions only) | auto (the algorithm's choice, resolved at load)
    save_every_steps: int = 25  # checkpoint cadence; 0: only at the end
    keep_checkpoints: int = 2  # newest complete checkpoints kept
    trajectory_every_steps: int = 10  # write a sample of the step's scored episodes (token ids, behaviour and
    # teacher logprobs) to trajectories/train_step_N.parquet every this many steps and at the first and the
    # last step, for `opd report`; 0: never
    trajectory_episodes: int = 4  # episodes in each such sample (the first ones of the step)
    backend: Literal["ray", "local"] = "ray"  # ray: three actors; local: the same roles in this process, no Ray (pdb)
    async_steps: int = 0  # 1: step k+1's rollout runs while step k is scored and trained (weights one update stale)
    teacher_check: Literal["warn", "error", "ignore"] = "warn"  # a teacher not clearly better than the student at
    # step 0 (held-out success, two standard errors): warn on the console and in summary.json, stop the run, or ignore it
    sampling_check: Literal["warn", "error", "ignore"] = "warn"  # the first step's sampled actions valid far less often
    # than greedy play at step 0 (more than 25 points): warn on the console and in summary.json, stop the run, or ignore it
    max_restarts: int = 2  # an actor that dies (its process killed): the run restarts every role from the last
    # complete checkpoint and goes on, this many times; then it stops, naming the actor (Ray backend)
    preempt_grace_s: float = 60.0  # on SIGTERM (preemption, `ray job stop`): finish the step, save it and stop within
    # this many seconds, then exit 143; a step still running then is abandoned, the last checkpoint kept


@dataclass
class LoggingConfig:
    """Where metrics go besides ``metrics.jsonl`` and tensorboard (always written)."""

    wandb_project: str | None = None  # a Weights & Biases project; needs `pip install wandb` (the `tracking` extra)
    wandb_mode: Literal["offline", "online"] = "offline"  # offline: files under RUN_DIR/wandb, synced later
    # with `wandb sync`; online: streamed (needs a login and the network)
    mlflow: bool = False  # also log to an MLflow file store at RUN_DIR/mlruns (needs `pip install mlflow`)


@dataclass
class ResourcesConfig:
    """Ray placement. On one machine a local Ray starts; ``RAY_ADDRESS`` joins a cluster."""

    num_cpus: int = 0  # CPUs for a local Ray; 0: all of this machine's
    teacher_cpus: float = 0.5  # CPU share of the TeacherWorker actor
    rollout_cpus: float = 0.5  # CPU share of the RolloutWorker actor
    trainer_cpus: float = 1.0  # CPU share of the StudentTrainer actor
    teacher_gpus: float = 0.0  # GPUs of the TeacherWorker actor
    rollout_gpus: float = 0.0  # GPUs of the RolloutWorker actor
    trainer_gpus: float = 0.0  # GPUs of the StudentTrainer actor
    teacher_replicas: int = 1  # teacher actors; a step's trajectories are scored shared among them
    rollout_replicas: int = 1  # rollout actors; a step's episodes are played shared among them
    trainer_ranks: int = 1  # trainer actors: one DeepSpeed group (trainer.zero_stage) over them, the
    # batch split among them; the <role>_cpus / <role>_gpus above are per actor
    torch_threads: int = 0  # intra-op threads per actor; 0: the machine's core count
    actor_timeout_s: float = 3600.0  # an actor call (a step's rollouts, scoring, training, a checkpoint)
    # that has not answered after this long counts as hung: the run stops, its last checkpoint intact
    placement: Literal["pack", "spread", "strict_pack", "strict_spread"] = "pack"  # each role's placement group:
    # its actors on as few nodes as fit (pack), as many as possible (spread), one node (strict_pack), one node each (strict_spread)
    placement_timeout_s: float = 60.0  # how long to wait for resources the cluster has but others hold;
    # a request no node can hold fails at once


@dataclass
class OPDConfig:
    """A whole run. Sections map one-to-one onto the boxes of the loop (docs/architecture.md)."""

    name: str = "run"  # a label for logs
    algorithm: str = "vanilla_opd"  # a registered algorithm (opd.algorithms.ALGORITHMS): vanilla_opd | grpo | pivot_opd | actfirst_opd
    student: ModelConfig = field(default_factory=ModelConfig)
    teacher: ModelConfig = field(default_factory=ModelConfig)
    teachers: dict[str, TeacherConfig] = field(default_factory=dict)  # more teachers by name, each graded
    # environment of env.mix routed to one (docs/teachers.md); two that name the same model load it once
    env: EnvConfig = field(default_factory=EnvConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    supervision: SupervisionConfig = field(default_factory=SupervisionConfig)
    actfirst: ActFirstConfig = field(default_factory=ActFirstConfig)
    pivot: PivotConfig = field(default_factory=PivotConfig)
    curriculum: CurriculumConfig = field(default_factory=CurriculumConfig)
    losses: list[LossConfig] = field(default_factory=lambda: [LossConfig(name="reverse_kl")])
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    run: RunConfig = field(default_factory=RunConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    resources: ResourcesConfig = field(default_factory=ResourcesConfig)


class Bound(NamedTuple):
    """The sensible range of a numeric key: ``low <= value <= high``, either end strict when its
    flag is set. Every value must also be finite."""

    low: float
    high: float
    low_strict: bool = False
    high_strict: bool = False

    def holds(self, value: float) -> bool:
        above = value > self.low if self.low_strict else value >= self.low
        below = value < self.high if self.high_strict else value <= self.high
        return math.isfinite(value) and above and below

    def describe(self) -> str:
        def num(x: float) -> str:
            return f"{x:,.0f}" if float(x).is_integer() and abs(x) >= 10_000 else f"{x:g}"

        return (f"{num(self.low)} {'<' if self.low_strict else '<='} value "
                f"{'<' if self.high_strict else '<='} {num(self.high)}")


_SEED = Bound(0, 2**32 - 1)
_PROB = Bound(0, 1)
_TOKENS = Bound(1, 1_000_000)  # a per-turn or per-episode token budget
_CAP = Bound(0, 10**9)  # a size cap where 0 turns the cap off
_COUNT = Bound(1, 10**7)
_CPUS = Bound(0, 100_000)
_GPUS = Bound(0, 10_000)

# Every int or float field of the schema, by dataclass and field name (a test keeps this
# complete): :func:`opd.config.validate` refuses a value outside its bound, and NaN or infinity
# anywhere, with the bound in the message.
BOUNDS: dict[type, dict[str, Bound]] = {
    TinyArchConfig: {"hidden_size": Bound(1, 65_536), "num_layers": Bound(1, 1_024), "num_heads": Bound(1, 1_024),
                     "intermediate_size": Bound(1, 1 << 20), "vocab_size": Bound(0, 1 << 24)},
    BootstrapConfig: {"n_episodes": _COUNT, "explore_prob": Bound(0, 1, high_strict=True), "sft_steps": Bound(0, 10**7),
                      "batch_size": Bound(1, 65_536), "learning_rate": Bound(0, 1, low_strict=True),
                      "tokenizer_vocab_size": Bound(256, 1 << 20), "corpus_episodes": _COUNT,
                      "action_only_prob": _PROB, "hint_prob": _PROB, "seed": _SEED,
                      "init_layers": Bound(0, 10_000), "dagger_episodes": Bound(0, 10**7),
                      "dagger_temperature": Bound(0, 100)},
    ModelConfig: {"prefix_cache_mb": Bound(0, 10**7), "tensor_parallel_size": Bound(1, 1_024)},
    ServerConfig: {"timeout_s": Bound(0, 86_400, low_strict=True), "connect_timeout_s": Bound(0, 3_600, low_strict=True),
                   "retries": Bound(0, 1_000), "in_flight": Bound(1, 1_024), "prompts_per_request": Bound(1, 65_536),
                   "replica_tolerance": Bound(0, 100)},
    LoraConfig: {"rank": Bound(0, 65_536), "alpha": Bound(0, 1e6, low_strict=True), "dropout": Bound(0, 1, high_strict=True)},
    TeacherConfig: {"replicas": Bound(0, 4_096), "cpus": Bound(-1, 100_000), "gpus": Bound(-1, 10_000)},
    MixEnvConfig: {"share": Bound(0, 1e6, low_strict=True)},
    EnvConfig: {"timeout_s": Bound(0, 86_400, low_strict=True), "memory_limit_mb": Bound(0, 10**8),
                "cpu_time_limit_s": Bound(0, 86_400)},
    RolloutConfig: {"episodes_per_step": _COUNT, "max_new_tokens": _TOKENS, "temperature": Bound(0, 100),
                    "group_size": _COUNT, "max_context_tokens": Bound(1, 100_000_000)},
    SupervisionConfig: {"top_k": Bound(1, 1_000_000), "score_batch_size": _COUNT, "score_batch_tokens": _CAP},
    ActFirstConfig: {"action_max_new_tokens": _TOKENS},
    PivotConfig: {"recovery_turns": Bound(0, 1_000), "judge_max_new_tokens": _TOKENS, "hint_top_k": Bound(1, 1_000_000)},
    CurriculumConfig: {"start_depth": Bound(1, 100_000), "full_depth_step": Bound(0, 10**9), "horizon": Bound(0, 100_000),
                       "stages": Bound(1, 100_000), "prefix_share": _PROB, "prefix_fraction": Bound(0, 1, high_strict=True),
                       "prefix_end_step": Bound(0, 10**9), "guide_share": Bound(0, 1, high_strict=True),
                       "guide_end_step": Bound(0, 10**9)},
    LossConfig: {"weight": Bound(-1e6, 1e6)},
    TrainerConfig: {"learning_rate": Bound(0, 1, low_strict=True), "warmup_steps": Bound(0, 10**9),
                    "min_lr_ratio": _PROB, "weight_decay": Bound(0, 100), "adam_beta1": Bound(0, 1, high_strict=True),
                    "adam_beta2": Bound(0, 1, high_strict=True), "grad_clip_norm": Bound(0, 1e6),
                    "micro_batch_size": _COUNT, "micro_batch_tokens": _CAP, "max_nonfinite_steps": Bound(1, 10**6),
                    "vocab_chunk_tokens": Bound(-1, 10**9)},
    RunConfig: {"total_steps": Bound(1, 10**9), "seed": _SEED, "eval_every_steps": Bound(0, 10**9),
                "eval_episodes": _COUNT, "save_every_steps": Bound(0, 10**9), "keep_checkpoints": Bound(1, 10_000),
                "trajectory_every_steps": Bound(0, 10**9), "trajectory_episodes": Bound(1, 100_000),
                "async_steps": Bound(0, 1), "max_restarts": Bound(0, 1000),
                "preempt_grace_s": Bound(1, 86_400)},
    ResourcesConfig: {"num_cpus": _CPUS, "teacher_cpus": _CPUS, "rollout_cpus": _CPUS, "trainer_cpus": _CPUS,
                      "teacher_gpus": _GPUS, "rollout_gpus": _GPUS, "trainer_gpus": _GPUS,
                      "torch_threads": Bound(0, 100_000), "actor_timeout_s": Bound(0, 10**7, low_strict=True),
                      "placement_timeout_s": Bound(0, 10**7, low_strict=True), "teacher_replicas": Bound(1, 4_096),
                      "rollout_replicas": Bound(1, 4_096), "trainer_ranks": Bound(1, 4_096)},
}


def bound_of(schema: type, name: str) -> Bound | None:
    """The bound of field ``name`` of dataclass ``schema``, or of the class it inherits it from."""
    for cls in schema.__mro__:
        if name in BOUNDS.get(cls, {}):
            return BOUNDS[cls][name]
    return None
