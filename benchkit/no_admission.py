"""The baseline of bench/admission.py: serving as it was before admission by
KV capacity. The router routes every request at once, whatever room the
decode workers report (``RetryBackend``); a decode worker reserves nothing
for its running sequences' growth and refuses a push that does not fit
with RESOURCE_EXHAUSTED at once (``RefusingDecodeActor``), so the router
prefills the request again elsewhere, up to ``tuning.max_attempts`` tries."""

from __future__ import annotations

from decode_pool.actor import DecodeActor
from router.admission import Admitted
from router.ray_backend import RayBackend
from router.route_admission import RouteAdmission


class RetryRoutes(RouteAdmission):
    async def admit(self, inp, tokens, avoid):
        plan = self.plan(tokens, inp.cache_salt, avoid)
        return Admitted(plan, plan.decode.name, 0)


class RetryBackend(RayBackend):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.routes = RetryRoutes(self)


class RefusingDecodeActor(DecodeActor):
    @staticmethod
    def make_worker(name, config, transfer, index, host):
        worker = DecodeActor.make_worker(name, config, transfer, index, host)
        worker.pool_store.admit = None
        worker.engine.scheduler.reserve_growth = False
        worker.kv_server.service.wait_for_room = False
        return worker
