"""The same loop with the engines in this process (no gRPC, no processes): the
in-process baseline for benchmarks and the harness for losslessness tests."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from draft_service.config import DraftConfig
from draft_service.runtime import DraftRuntime
from gateway.clients import DraftClient, LocalDraft, LocalTarget
from gateway.scheduler import Failed, Finished, GenerationRequest, Limits, Scheduler, SeqStats
from specsplit.forced import ForcedAcceptance
from specsplit.models.parallel import TensorParallel
from target_service.config import TargetConfig
from target_service.runtime import TargetRuntime


@dataclass
class LocalResult:
    tokens: list[int]
    finish: str
    stats: SeqStats


class LocalEngines:
    def __init__(self, target_cfg: TargetConfig, draft_cfg: DraftConfig | None) -> None:
        self.target = TargetRuntime(target_cfg.validate(), TensorParallel())
        self.draft = None
        self.forced: ForcedAcceptance | None = None  # a benchmark mode: the target must allow it (specsplit.forced)
        self.draft_ahead = False  # (gateway.ahead)
        if draft_cfg is not None:
            self.draft = DraftRuntime(draft_cfg.validate())
            assert self.target.writer is not None
            self.draft.attach(self.target.writer.descriptor)
            self.draft.warm_graphs()

    def generate(self, requests: list[GenerationRequest], draft_client: DraftClient | None = None
                 ) -> list[LocalResult]:
        """Run the requests concurrently through one scheduler; results in request order."""
        return asyncio.run(self._generate(requests, draft_client))

    async def _generate(self, requests: list[GenerationRequest], draft_client: DraftClient | None
                        ) -> list[LocalResult]:
        draft = draft_client or (LocalDraft(self.draft) if self.draft is not None else None)
        sched = Scheduler(LocalTarget(self.target), draft, self.target.cfg.max_sequences,
                          Limits(max_queue=10_000, max_queued_per_client=10_000, stream_buffer=1 << 30,
                                 draft_ahead=self.draft_ahead),
                          max_steps=self.draft.cfg.max_steps if self.draft is not None else 8)
        sched.forced = self.forced
        self.scheduler = sched  # for tests that inject faults
        if draft is not None:
            sched.draft_restored()
        sched.start()
        try:
            seqs = [sched.submit(r) for r in requests]
            results = []
            for seq in seqs:
                while True:
                    ev = await seq.events.get()
                    if isinstance(ev, Failed):
                        raise RuntimeError(f"{ev.code.name}: {ev.message}")
                    if isinstance(ev, Finished):
                        results.append(LocalResult(seq.generated, ev.reason, seq.stats))
                        break
            deadline = time.monotonic() + 60
            while sched.busy:  # let the last releases go out
                if time.monotonic() > deadline:
                    raise RuntimeError(f"scheduler still busy after the last result: running={len(sched.running)} "
                                       f"waiting={len(sched.waiting)} target_down={sched.target_down} "
                                       f"draft_down={sched.draft_down} releases={sched.target_releases} "
                                       f"draft_releases={sched.draft_releases} free={sched.free_generations}")
                await asyncio.sleep(0.005)
            return results
        finally:
            await sched.stop()

    def close(self) -> None:
        self.target.close()
