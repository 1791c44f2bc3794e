"""What `make run`'s flags mean: the command line (`parse_args`) and the recipe each service is
told from it (CLAWRL_* settings): the trainer's (`training_env`), the judge's (`judge_env`, from
`--method`), the tenants' and the gateway's. stack.py starts the processes with them."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import terminal

REPO = Path(__file__).resolve().parents[2]

# AdamW's step for LoRA on SmolLM2-135M in the preference demo (README, "The demo that trends").
LORA_LR = 5e-4
LORA_RANK = 16


def default_torch_threads() -> int:
    """The cores split between the three torch processes (two engines, the trainer): each
    defaulting to every core oversubscribes them, and a busy engine then starves the trainer."""
    return max(1, (os.cpu_count() or 1) // 3)


# The learning methods of `--method` (the judge's mode and the trainer's advantage estimator).
ESTIMATORS = {"rl": "grpo", "opd": "on_policy_distillation", "combine": "combine"}
# Hints with no judge model: the corrective sentences of the user's next message (`clawrl
# simulate`'s user writes "<remark> Next: <question>"; the question is not feedback).
HINT_FN = "clawrl.judge.hint_examples:corrective_sentences"
HINT_FN_ARGS = '{"drop_after": "Next:"}'
OPD_CLIP = 2.0  # OpenClaw-RL's bound on a token's teacher - student gap


def needs_judge_engine(args: argparse.Namespace) -> bool:
    """Whether the judge engine has work: PRM votes (rl and combine without a reward plug-in),
    hint votes (opd and combine without a hint plug-in), or teaching (--teacher judge)."""
    if args.method == "config":
        return True
    prm = args.method != "opd" and not args.reward_fn
    hint_votes = args.method != "rl" and not args.hint_fn
    return prm or hint_votes or (args.method != "rl" and args.teacher == "judge")


def judge_env(args: argparse.Namespace) -> dict[str, str]:
    """The judge's recipe from --method and the plug-in flags (the judge reads CLAWRL_*)."""
    if args.method == "config":  # mode and reward from clawrl.toml ([judging])
        return terminal.judge_env(args)
    env = {"CLAWRL_JUDGING__MODE": args.method, "CLAWRL_JUDGING__PRM": args.judge_prm}
    env |= terminal.judge_env(args)
    if args.reward_fn:
        env["CLAWRL_JUDGING__REWARD_FN"] = args.reward_fn
    if args.method == "rl":
        return env
    env |= {
        "CLAWRL_TEACHER__ENGINE": args.teacher,
        "CLAWRL_TEACHER__POLICY_ENGINE_URL": f"http://127.0.0.1:{args.policy_port}",
        "CLAWRL_JUDGING__HINT_CANDIDATES": str(args.hint_candidates),
        "CLAWRL_JUDGING__HINT_SELECT": args.hint_select,
    }
    if args.hint_fn:  # the plug-in alone: the 135M judge gives next to no usable hint votes
        env |= {"CLAWRL_JUDGING__HINT_FN": args.hint_fn, "CLAWRL_JUDGING__HINT_VOTES": "false"}
        if args.hint_fn == HINT_FN:
            env["CLAWRL_JUDGING__HINT_FN_ARGS"] = HINT_FN_ARGS
    return env


def training_env(args: argparse.Namespace) -> dict[str, str]:
    """The trainer's recipe from stack.py's flags (the trainer reads CLAWRL_* settings). Unset
    flags leave the setting to clawrl.toml or the environment."""
    env = {"CLAWRL_TRAIN__NUM_THREADS": str(args.torch_threads)}
    if args.lora_rank:
        env |= {
            "CLAWRL_LORA__ENABLED": "true",
            "CLAWRL_LORA__RANK": str(args.lora_rank),
            "CLAWRL_LORA__ALPHA": str(args.lora_alpha),
        }
    lr = args.lr if args.lr is not None else (LORA_LR if args.lora_rank else None)
    if lr is not None:
        env["CLAWRL_PPO__LR"] = str(lr)
    if args.baseline == "batch":
        # Live traffic asks each prompt once: the batch's mean reward is the baseline.
        env |= {"CLAWRL_ADVANTAGE__NORMALIZE_GROUPS": "true", "CLAWRL_ADVANTAGE__GROUP_BY": "batch"}
    elif args.baseline == "none":
        env["CLAWRL_ADVANTAGE__NORMALIZE_GROUPS"] = "false"
    if args.method != "config":
        env["CLAWRL_ADVANTAGE__ESTIMATOR"] = ESTIMATORS[args.method]
    if args.method in ("opd", "combine"):
        env["CLAWRL_ADVANTAGE__OPD_CLIP"] = str(OPD_CLIP)
    return env | terminal.training_env(args)


def tenant_env(args: argparse.Namespace) -> dict[str, str]:
    """[tenants] from stack.py's flags, for every process (the gateway routes by tenant, the
    trainer steps per tenant, the weight-sync job serves each tenant its versions)."""
    env = {}
    if args.tenants != "config":
        env["CLAWRL_TENANTS__MODE"] = args.tenants
    if args.tenant_batch is not None:
        env["CLAWRL_TENANTS__MIN_SAMPLES_PER_STEP"] = str(args.tenant_batch)
    return env


def gateway_env(args: argparse.Namespace) -> dict[str, str]:
    """The API keys, for the gateway alone (a JSON list, as its settings read lists)."""
    return {"CLAWRL_SERVING__API_KEYS": json.dumps(args.api_key)} if args.api_key else {}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Run the clawrl stack locally on CPU.")
    parser.add_argument("--policy-model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--judge-model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--gateway-port", type=int, default=30000)
    parser.add_argument("--grpc-port", type=int, default=30001)
    parser.add_argument("--policy-port", type=int, default=30010)
    parser.add_argument("--judge-port", type=int, default=30011)
    parser.add_argument("--redis-port", type=int, default=6390)
    parser.add_argument("--prometheus-port", type=int, default=30090)
    parser.add_argument("--judge-grpc-port", type=int, default=30020, help="Judge gRPC (Score)")
    parser.add_argument("--judge-metrics-port", type=int, default=30021, help="judge /metrics")
    parser.add_argument("--trainer-metrics-port", type=int, default=30030, help="trainer /metrics")
    parser.add_argument(
        "--sync-metrics-port", type=int, default=30031, help="weight-sync launcher /metrics"
    )
    parser.add_argument(
        "--method",
        choices=("rl", "opd", "combine", "config"),
        default="rl",
        help="how turns become training signal: rl = a reward per turn (--reward-fn, else the "
        "judge's PRM votes), opd = on-policy distillation from a hindsight hint (--hint-fn, "
        "else the judge's hint votes) scored by the teacher, combine = both; config = the "
        "judge's [judging] and the trainer's [advantage] from clawrl.toml",
    )
    parser.add_argument(
        "--hint-fn",
        default=HINT_FN,
        help="opd/combine: hint plug-in module:function (judging.hint_fn); '' = the judge's "
        f"hint votes (default: {HINT_FN}, the corrective sentences of the user's next message)",
    )
    parser.add_argument(
        "--teacher",
        choices=("policy", "judge"),
        default="policy",
        help="opd/combine: who scores the hinted prompt: the policy engine's base weights (no "
        "adapter; one engine for both) or the judge engine",
    )
    parser.add_argument(
        "--hint-candidates", type=int, default=1, help="opd/combine: hint candidates kept per turn"
    )
    parser.add_argument(
        "--hint-select",
        choices=("longest", "shortest", "sequence_optimal", "token_optimal"),
        default="sequence_optimal",
        help="opd/combine with --hint-candidates > 1: how one is picked (judging.hint_select)",
    )
    parser.add_argument(
        "--judge-prm",
        choices=("votes", "logprob"),
        default="votes",
        help="the PRM's verdict when it scores (no --reward-fn): m sampled votes, or the yes/no "
        "log-probs of one forward pass (judging.prm)",
    )
    parser.add_argument(
        "--reward-fn",
        help="rl mode with this reward plug-in (module:function), e.g. "
        "clawrl.judge.reward_examples:remark_sentiment for `clawrl simulate`; unset: the "
        "judge's mode and reward from clawrl.toml ([judging])",
    )
    parser.add_argument(
        "--batch-size", type=int, default=8, help="trainable samples per trainer step"
    )
    parser.add_argument(
        "--engine",
        choices=("cpu", "sglang"),
        default="cpu",
        help="policy and judge engines: cpu = clawrl's CPU engine (SGLang's API; LoRA); sglang "
        "= real SGLang on its CPU path through clawrl-engine --backend sglang (`make "
        "setup-sglang` first; full fine-tuning only)",
    )
    parser.add_argument(
        "--lora-rank",
        type=int,
        help=f"train and serve a LoRA adapter of this rank on all seven projections (each new "
        f"version loaded by the engines with no pause); 0: full fine-tuning (a paused sync); "
        f"default {LORA_RANK} on the CPU engine, 0 on SGLang",
    )
    parser.add_argument("--lora-alpha", type=float, default=32.0, help="LoRA alpha")
    parser.add_argument(
        "--lr",
        type=float,
        help=f"trainer learning rate (ppo.lr); default {LORA_LR} with LoRA, else clawrl.toml's",
    )
    parser.add_argument(
        "--baseline",
        choices=("batch", "none", "config"),
        default="batch",
        help="advantage: batch = each reward minus the batch's mean, over its std (live "
        "traffic samples each prompt once); none = the reward itself; config = clawrl.toml's",
    )
    parser.add_argument(
        "--sync-interval", type=int, default=1, help="steps between policy versions (syncs)"
    )
    parser.add_argument(
        "--tenants",
        choices=("shared", "per_tenant", "config"),
        default="config",
        help="[tenants] mode: shared = one policy for every caller; per_tenant = each caller "
        "(an API key's tenant, see --api-key) trains and is served a LoRA adapter of its own; "
        "config = clawrl.toml's (default shared)",
    )
    parser.add_argument(
        "--tenant-batch",
        type=int,
        help="per_tenant: samples of one tenant per step of its adapter "
        "([tenants] min_samples_per_step; default clawrl.toml's, else 4)",
    )
    parser.add_argument(
        "--api-key",
        action="append",
        default=[],
        help="an API key the gateway accepts (repeat for more; each key is a tenant); none: "
        "the API is open (or clawrl.toml's [serving] api_keys)",
    )
    parser.add_argument(
        "--context-length",
        type=int,
        default=16384,
        help="context window of every process (engines, gateway, judge, trainer) as "
        "CLAWRL_MODEL__CONTEXT_LENGTH: OpenClaw's first request alone is ~13k tokens; beyond "
        "the model's trained context (SmolLM2: 8192) engines and trainer stretch RoPE alike "
        "(model.rope_scaling, default yarn); 0: the model's own or clawrl.toml's",
    )
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=default_torch_threads(),
        help="torch threads of each engine and of the trainer (default: a third of the cores)",
    )
    terminal.add_arguments(parser)
    parser.add_argument("--status-interval", type=float, default=5.0, help="seconds")
    parser.add_argument("--run-dir", type=Path, default=REPO / "run", help="Redis data, logs...")
    return parser.parse_args(argv)
