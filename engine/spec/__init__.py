"""Speculative decoding: proposers (prompt lookup, draft model), the verify
rule that keeps the target's distribution, and the engine glue."""

from .decoder import SpecDecoder
from .proposer import NgramProposer, Proposal, Proposer
from .verify import Verdict, acceptance_probs, residual, verify_greedy, verify_sampled

__all__ = [
    "NgramProposer",
    "Proposal",
    "Proposer",
    "SpecDecoder",
    "Verdict",
    "acceptance_probs",
    "residual",
    "verify_greedy",
    "verify_sampled",
]
