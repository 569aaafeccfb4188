"""Torch-free types the router and the workers exchange.

Nothing here imports torch (nor transformers): ``tandem serve``'s router
process imports these and must not load torch. The engine builds and reads
the same types (engine/sampling.py and engine/sequence.py re-export them).

* ``protocol.sampling``: ``SamplingParams``, a request's validated sampling
  parameters;
* ``protocol.outputs``: ``RequestOutput`` and ``TokenLogprobs``, what one
  engine step produced for one request.
"""
