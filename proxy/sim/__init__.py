"""The built-in simulated LLM engine and multi-tenant workload.

answers: deterministic answers; faults: cross-tenant leak injection with a truth file;
workload: realistic multi-tenant traffic; server: the OpenAI-compatible aiohttp engine.
"""

from proxy.sim.answers import GENERIC_SENTENCE_TEMPLATES, answer_for
from proxy.sim.faults import FAULT_KINDS, Fault, FaultInjector
from proxy.sim.server import SimConfig, make_app, start_sim
from proxy.sim.workload import PUBLIC_DOCUMENTS, SHARED_SYSTEM_PROMPTS, SimRequest, Workload

__all__ = [
    "FAULT_KINDS",
    "GENERIC_SENTENCE_TEMPLATES",
    "PUBLIC_DOCUMENTS",
    "SHARED_SYSTEM_PROMPTS",
    "Fault",
    "FaultInjector",
    "SimConfig",
    "SimRequest",
    "Workload",
    "answer_for",
    "make_app",
    "start_sim",
]
