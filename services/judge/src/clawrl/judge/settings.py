"""The judge's one settings object (env `CLAWRL_<SECTION>__<FIELD>`, or `clawrl.toml`)."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, SecretStr, model_validator

from clawrl.common.episodes import EpisodeSettings
from clawrl.common.feedback import FeedbackSettings
from clawrl.common.settings import ClawrlSettings, ModelSettings, RedisSettings, Section
from clawrl.judge.hints import BY_OVERLAP, Selection

Mode = Literal["rl", "opd", "combine"]


class JudgingSettings(Section):
    """What signal the judge makes from a turn (one deployment runs one mode)."""

    mode: Mode = Field(
        "rl",
        description="rl: binary reward from m PRM votes; opd: teacher log-probs from a "
        "hindsight hint; combine: both, one sample per turn.",
    )
    reward_fn: str | None = Field(
        None,
        description="A reward plug-in `module:function` (sync or async, see "
        "clawrl.judge.rewards) used in place of the PRM score in rl and combine.",
    )
    reward_fn_args: dict[str, Any] = Field(
        default_factory=dict,
        description="Keyword arguments passed to reward_fn on every call (e.g. {word = 'ok'}).",
    )
    votes: int = Field(3, ge=1, le=32, description="m: PRM (or hint) votes per turn.")
    prm: Literal["votes", "logprob"] = Field(
        "votes",
        description="How the PRM score is made: votes (m sampled answers ending in \\boxed{}, "
        "by majority) or logprob (one forward pass of a yes/no prompt on the judge engine: "
        "the probabilities of its yes-like and no-like first tokens; needs backend.kind=sglang).",
    )
    prm_margin: float = Field(
        0.2,
        ge=0.0,
        lt=0.5,
        description="prm=logprob: +1 when the yes share p_yes/(p_yes+p_no) is above 0.5 + this, "
        "-1 when below 0.5 - this, else 0.",
    )
    prm_top_logprobs: int = Field(
        20,
        ge=1,
        description="prm=logprob: top log-probs read at the first answer token; a yes/no token "
        "outside them counts as probability 0 (neither in them: no verdict, counted invalid).",
    )
    promote_first_in_session: bool = Field(
        True,
        description="rl: a session's first 0-scored turn with a next state is trained (reward "
        "0, `promoted`) while the session has no effective sample yet; state kept in Redis.",
    )
    min_hint_chars: int = Field(
        10, ge=0, description="A hint must be longer than this to be used (opd, combine)."
    )
    hint_fn: str | None = Field(
        None,
        description="A hint plug-in `module:function` (see clawrl.judge.hint_fns): the hint of a "
        "turn without a judge model, asked after an explicit feedback's comment and before "
        "the judge's hint votes (opd, combine).",
    )
    hint_fn_args: dict[str, Any] = Field(
        default_factory=dict,
        description="Keyword arguments passed to hint_fn on every call.",
    )
    hint_votes: bool = Field(
        True,
        description="opd/combine: ask the judge's hint votes when neither feedback nor hint_fn "
        "gave a hint (off: hints come only from those two).",
    )
    hint_candidates: int = Field(
        1,
        ge=1,
        le=16,
        description="Accepted hints kept per turn (deduplicated, from the first source that gives "
        "any); more than one: each is scored by the teacher and one is picked by hint_select.",
    )
    hint_select: Selection = Field(
        "longest",
        description="How one of several hint candidates is picked: longest or shortest (by "
        "characters), sequence_optimal (the candidate whose hinted teacher's top-K agrees with "
        "the student's on the most tokens of the response), token_optimal (per token, the "
        "candidate that agrees most there; OpenClaw-RL's multi-candidate selection).",
    )


class PromptSettings(Section):
    """How much of a turn the judge prompt shows (middle-shortened with a visible marker)."""

    context_messages: int = Field(
        4, ge=0, description="Messages before the reply shown to the judge (the last ones)."
    )
    max_message_chars: int = Field(
        2000, gt=100, description="A context or next-state message is shortened past this."
    )
    max_response_chars: int = Field(
        4000, gt=100, description="The assistant's reply is shortened past this."
    )


class BackendSettings(Section):
    """Where the votes (PRM and hint) go: an SGLang-API engine or an OpenAI-compatible API."""

    kind: Literal["sglang", "openai"] = Field(
        "sglang", description="sglang: the judge engine's /generate; openai: chat completions."
    )
    engine_url: str | None = Field(
        "http://localhost:30011",
        description="The judge engine (SGLang API): votes when kind=sglang, and the teacher's "
        "prompt log-probs in opd/combine (required there, whatever kind is).",
    )
    openai_base_url: str | None = Field(
        None, description="kind=openai: base URL of the chat API (e.g. https://host/v1)."
    )
    openai_model: str | None = Field(None, description="kind=openai: the model to ask.")
    api_key: SecretStr | None = Field(None, description="kind=openai: the API key.")
    api_key_file: Path | None = Field(
        None, description="kind=openai: a file holding the API key (a mounted Secret)."
    )
    temperature: float = Field(0.6, ge=0, description="Sampling temperature of a vote.")
    max_new_tokens: int = Field(512, gt=0, description="Longest vote.")
    context_tokens: int | None = Field(
        None,
        gt=0,
        description="The judge model's context window; sglang: the judge model's config "
        "when unset; openai: unset = no token check (only the character limits).",
    )
    timeout_s: float = Field(300.0, gt=0, description="Longest wait for one engine call.")
    max_connections: int = Field(256, gt=0, description="Connection pool size per engine.")

    def openai_key(self) -> str:
        if self.api_key is not None:
            return self.api_key.get_secret_value()
        if self.api_key_file is not None:
            return self.api_key_file.read_text().strip()
        return "EMPTY"


class TeacherSettings(Section):
    """Teacher log-probs over `hinted prompt + recorded response` (opd, combine)."""

    top_k: int = Field(
        0, ge=0, le=64, description="Also store the teacher's top-K ids/log-probs per token."
    )
    engine: Literal["judge", "policy"] = Field(
        "judge",
        description="Which engine teaches: judge (backend.engine_url) or policy (the policy "
        "engine's base weights, asked with no adapter: with LoRA the frozen base model, so one "
        "engine serves the policy and the teacher on a laptop; with full fine-tuning the "
        "current policy itself).",
    )
    policy_engine_url: str | None = Field(
        "http://localhost:30010",
        description="The policy engine (SGLang API): the teacher when engine=policy, and the "
        "student's top-K (its base weights) for the sequence/token_optimal hint selection.",
    )
    select_top_k: int = Field(
        8,
        ge=1,
        le=64,
        description="K of the top-K sets compared by the sequence/token_optimal selection.",
    )


class WorkerSettings(Section):
    """The pool of stream workers in the `judges` consumer group."""

    group: str = Field("judges", description="Consumer group on the turns stream.")
    consumer: str = Field(
        default_factory=socket.gethostname,
        description="This worker's consumer name (the pod name); unique per worker.",
    )
    workers: int = Field(1, ge=1, le=64, description="Consumers in this process.")
    concurrency: int = Field(
        64, ge=1, description="Turns judged at once per worker (engine calls overlap)."
    )
    read_batch: int = Field(256, ge=1, description="Most entries read per XREADGROUP.")
    block_ms: int = Field(1000, ge=1, description="XREADGROUP block time when idle.")
    claim_idle_ms: int = Field(
        60_000,
        ge=100,
        description="Entries pending this long on a consumer are taken over (XCLAIM); "
        "turns in progress are kept fresh, so only a dead worker's entries qualify.",
    )
    max_deliveries: int = Field(
        5, ge=1, description="A turn delivered this often without success is dead-lettered."
    )
    retry_initial_s: float = Field(0.5, gt=0, description="First backoff when an engine is down.")
    retry_max_s: float = Field(30.0, gt=0, description="Longest backoff when an engine is down.")
    key_prefix: str = Field("clawrl:judge", description="Prefix of the judge's Redis keys.")
    done_ttl_s: int = Field(
        7 * 86400, gt=0, description="How long a judged turn id is remembered (dedupe)."
    )
    session_ttl_s: int = Field(
        7 * 86400, gt=0, description="How long a session's promotion state is kept."
    )
    drain_timeout_s: float = Field(
        30.0, gt=0, description="At shutdown, how long in-flight turns may finish."
    )


class RetentionSettings(Section):
    """Streams do not grow without bound: the turns and samples streams are trimmed below what
    every consumer group acknowledged (XTRIM MINID); the audit stream is capped by count and
    by age. Audit entries carry replies and votes of up to ~20k characters each, so a count
    alone does not bound Redis's memory."""

    interval_s: float = Field(30.0, gt=0, description="How often streams are trimmed.")
    keep_s: float = Field(
        3600.0,
        ge=0,
        description="Acknowledged entries younger than this stay (MINID floor) for inspection.",
    )
    audit_maxlen: int = Field(
        200_000, gt=0, description="Approximate cap on the audit stream (judgements)."
    )
    audit_keep_s: float = Field(
        7 * 24 * 3600.0,
        gt=0,
        description="Audit records older than this are trimmed (XTRIM MINID); export them "
        "with `clawrl-judge export` first if they must be kept longer.",
    )


class AuditSettings(Section):
    """The audit trail: one JSON record per judgement (`clawrl-judge export` writes JSONL)."""

    stream: str = Field("clawrl:judgements", description="Stream of judgement records.")
    keep_vote_text: bool = Field(True, description="Keep every vote's full text.")


class ServerSettings(Section):
    """The Judge gRPC service (Score) and the HTTP metrics/health endpoint."""

    host: str = Field("127.0.0.1", description="Address both servers listen on.")
    grpc_port: int = Field(30020, ge=0, lt=65536, description="Judge gRPC port (0 = any free).")
    metrics_port: int = Field(
        30021, ge=0, lt=65536, description="/metrics, /healthz, /readyz (0 = any free)."
    )


class JudgeSettings(ClawrlSettings):
    """Everything the judge needs, built once at start and passed down."""

    model: ModelSettings = Field(
        default_factory=ModelSettings,
        description="The POLICY model: its tokenizer and chat template render hinted prompts.",
    )
    judge_model: ModelSettings | None = Field(
        None,
        description="The judge engine's model (tokenizer/template of the votes, sglang "
        "backend); unset = the policy model.",
    )
    redis: RedisSettings = Field(default_factory=RedisSettings)
    judging: JudgingSettings = Field(default_factory=JudgingSettings)
    prompt: PromptSettings = Field(default_factory=PromptSettings)
    backend: BackendSettings = Field(default_factory=BackendSettings)
    teacher: TeacherSettings = Field(default_factory=TeacherSettings)
    workers: WorkerSettings = Field(default_factory=WorkerSettings)
    retention: RetentionSettings = Field(default_factory=RetentionSettings)
    audit: AuditSettings = Field(default_factory=AuditSettings)
    feedback: FeedbackSettings = Field(
        default_factory=FeedbackSettings,
        description="Explicit feedback (POST /v1/feedback on the gateway): how it is merged.",
    )
    episodes: EpisodeSettings = Field(
        default_factory=EpisodeSettings,
        description="Episodes' turns (X-Episode): how long they wait for the outcome (POST "
        "/v1/outcomes on the gateway) and how it meets each turn's step score.",
    )
    judge_server: ServerSettings = Field(
        default_factory=ServerSettings,
        description="[judge_server]: its own section, since the trainer has a [server] too.",
    )

    @model_validator(mode="after")
    def _check(self) -> JudgeSettings:
        b = self.backend
        j, t = self.judging, self.teacher
        if self.needs_teacher and t.engine == "policy" and not t.policy_engine_url:
            raise ValueError("teacher.engine=policy needs teacher.policy_engine_url")
        if self.student_reference and not t.policy_engine_url:
            raise ValueError(
                f"judging.hint_select={j.hint_select} compares each hinted teacher with the "
                "student: set teacher.policy_engine_url (the policy engine)"
            )
        comments = self.feedback.enabled and self.feedback.comment_as_hint
        if self.needs_teacher and not (j.hint_fn or j.hint_votes or comments):
            raise ValueError(
                f"judging.mode={j.mode} has no hint source: set judging.hint_fn, turn "
                "judging.hint_votes on, or feedback.comment_as_hint"
            )
        if self.needs_teacher and t.engine == "judge" and not b.engine_url:
            raise ValueError(
                f"judging.mode={self.judging.mode} needs teacher prompt log-probs, which only an "
                "SGLang-API engine gives: set backend.engine_url (an OpenAI-compatible API "
                "cannot score a given response)"
            )
        if self.uses_prm and self.judging.prm == "logprob" and b.kind != "sglang":
            raise ValueError(
                "judging.prm=logprob reads the judge model's next-token log-probs, which only "
                "an SGLang-API engine gives: set backend.kind=sglang"
            )
        if self.needs_votes and b.kind == "sglang" and not b.engine_url:
            raise ValueError("backend.kind=sglang needs backend.engine_url")
        if self.needs_votes and b.kind == "openai" and not (b.openai_base_url and b.openai_model):
            raise ValueError("backend.kind=openai needs backend.openai_base_url and openai_model")
        if b.api_key_file is not None and not b.api_key_file.is_file():
            raise ValueError(f"backend.api_key_file {b.api_key_file} does not exist")
        return self

    @property
    def needs_teacher(self) -> bool:
        return self.judging.mode in ("opd", "combine")

    @property
    def needs_votes(self) -> bool:
        """A vote backend is asked: PRM votes unless a reward_fn replaces them (uses_prm), hint
        votes in opd and combine unless judging.hint_votes is off."""
        return (self.needs_teacher and self.judging.hint_votes) or self.uses_prm

    @property
    def student_reference(self) -> bool:
        """The hint selection compares each candidate's teacher with the student's top-K."""
        j = self.judging
        return self.needs_teacher and j.hint_candidates > 1 and j.hint_select in BY_OVERLAP

    @property
    def uses_prm(self) -> bool:
        """The PRM scores turns: rl and combine, unless a reward_fn replaces it."""
        return self.judging.mode != "opd" and not self.judging.reward_fn

    @property
    def waits_for_outcomes(self) -> bool:
        """Episodes' turns wait for their outcome: episodes on, and a mode with a reward (opd
        trains on the teacher only: there the outcome would go unused)."""
        return self.episodes.enabled and self.judging.mode != "opd"

    @property
    def vote_model(self) -> ModelSettings:
        return self.judge_model or self.model
