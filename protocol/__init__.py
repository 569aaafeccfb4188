"""Torch-free types the router and the workers exchange.

Nothing here imports torch (nor transformers): ``tandem serve``'s router
process imports these and must not load torch. The engine builds and reads
the same types (engine/sampling.py and engine/sequence.py re-export them).

* ``protocol.sampling``: ``SamplingParams``, a request's validated sampling
  parameters;
* ``protocol.outputs``: ``RequestOutput`` and ``TokenLogprobs``, what one
  engine step produced for one request;
* ``protocol.requests``: the router's call per try (``PrefillRequest``,
  ``DecodeRequest``) and a prefill's ``PrefillResult``;
* ``protocol.decode_start``: ``DecodeStart`` and ``FirstToken``, what a
  prefill's KV push carries (in its header, in its commit) for the decode
  worker to start the request;
* ``protocol.workers``: ``WorkerInfo`` (a worker's identity and addresses),
  ``WorkerStats`` (its counters) and ``WorkerHealth`` (a health answer).
"""

from protocol.outputs import RequestOutput, TokenLogprobs
from protocol.sampling import SamplingParams
from protocol.workers import WorkerHealth, WorkerInfo, WorkerStats

__all__ = [
    "RequestOutput",
    "SamplingParams",
    "TokenLogprobs",
    "WorkerHealth",
    "WorkerInfo",
    "WorkerStats",
]
