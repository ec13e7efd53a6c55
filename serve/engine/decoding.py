"""One request at a time through the speculative engine: the offline entry point used by
evaluation and calibration (SPEC section 5). There is no second decoding loop: this is
:class:`serve.engine.core.SpecEngine` with a single request (a fixed verification length by default,
or any scheduler given as an engine config), and a verification length of zero is plain
target-only decoding through the same path.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .builder import LoadedModels, build_engine
from .config import EngineConfig
from .core import RoundRecord, SpecEngine
from .requests import EngineRequest, SamplingParams
from .scheduler_registry import NEEDS_SPS
from .target_runner import TargetRunner

__all__ = ["SpeculativeDecoder", "GenerationResult", "RoundRecord"]


@dataclass
class GenerationResult:
    """Output of :meth:`SpeculativeDecoder.generate`.

    tokens: generated token ids (the EOS token, if any, is the last); finish_reason: ``"stop"``
    or ``"length"``; rounds: one record per decoding round after the prefill; prefill_s (time to
    the first token) and total_s: wall-clock seconds.
    """

    tokens: list[int]
    finish_reason: str
    rounds: list[RoundRecord] = field(default_factory=list)
    prefill_s: float = 0.0
    total_s: float = 0.0


class SpeculativeDecoder:
    """Decodes one request at a time with a target and an optional drafter.

    Args:
        target: :class:`TargetRunner` over the target model.
        drafter: a drafter whose ``target_layer_ids`` equal the runner's, or None.
        eos_token_ids: tokens that end generation.
        engine: the speculative engine's config (scheduler and its knobs; ``max_num_requests`` is
            1 here); None = fixed verification of ``num_draft_tokens`` (default: the drafter's
            block_size).
        sps_dir: where the dspark/async schedulers store or reuse their SPS(B) profile (profiled
            here up to one request's num_speculative_tokens + 1 tokens).
    Raises:
        ValueError: the drafter's layer ids differ from the runner's, or the scheduler needs a
            confidence head the drafter lacks.
    """

    def __init__(self, target: TargetRunner, drafter, eos_token_ids: list[int],
                 engine: EngineConfig | None = None, sps_dir: str | None = None):
        self.target, self.drafter, self.eos = target, drafter, list(eos_token_ids)
        self.models = LoadedModels(None, target.model, drafter, target, self.eos)
        self.engine_config = engine
        self._sps_dir = sps_dir
        self._engines: dict = {}
        self._engine(None)  # validates the drafter against the runner now

    @property
    def scheduler(self) -> str:
        """The scheduler speculative decoding runs with."""
        return self._engine(None).scheduler_name

    def _engine(self, num_draft_tokens: int | None) -> SpecEngine:
        key = num_draft_tokens
        if key not in self._engines:
            speculative = self.drafter is not None and num_draft_tokens != 0
            if speculative and self.engine_config is not None and num_draft_tokens is None:
                # one request at a time: no load to be invariant to, and evaluation measures
                # the drafter's acceptance under rejection sampling
                cfg = self.engine_config.model_copy(update={"max_num_requests": 1,
                                                            "seeded_sampling": "rejection"})
                if cfg.scheduler in NEEDS_SPS:  # one request: SPS up to the cap + 1
                    cap = cfg.speculative_tokens(self.drafter.config.block_size)
                    cfg = cfg.model_copy(update={"max_batch_tokens": cap + 1})
            else:
                cfg = EngineConfig(scheduler="fixed" if speculative else "none",
                                   num_speculative_tokens=num_draft_tokens or None,
                                   max_num_requests=1,
                                   sps_profile="off", seeded_sampling="rejection",
                                   attention=(self.engine_config.attention
                                              if self.engine_config is not None else "kernel"))
            self._engines[key] = build_engine(self.models, cfg, profile_dir=self._sps_dir,
                                              tokenizer=False)
        return self._engines[key]

    def generate(self, prompt_ids: list[int], max_new_tokens: int, temperature: float = 0.0,
                 seed: int = 0, num_draft_tokens: int | None = None) -> GenerationResult:
        """Generate up to ``max_new_tokens`` tokens after ``prompt_ids``.

        Args:
            prompt_ids: the rendered prompt (chat template applied), non-empty.
            max_new_tokens: hard cap on generated tokens (>= 1).
            temperature: 0 for greedy, else the sampling temperature of target and drafter.
            seed: seeds this request's own RNG.
            num_draft_tokens: tokens verified per round; None = the drafter's block_size, 0 =
                target only.
        Raises:
            serve.engine.errors.RequestError (a ValueError): empty prompt or max_new_tokens < 1.
        """
        req = EngineRequest("offline", list(prompt_ids),
                            SamplingParams(max_tokens=max_new_tokens, temperature=temperature,
                                           seed=seed))
        done = self._engine(num_draft_tokens).generate([req])[0]
        return GenerationResult(done.tokens, done.finish_reason, done.rounds, done.first_token_s,
                                done.total_s)
