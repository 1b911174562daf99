"""crosstalk as a mitmproxy script: ``mitmdump -s addons/crosstalk.py --mode reverse:URL``.

Options are prefixed ``crosstalk_`` (``--set crosstalk_config=PATH``). The logic lives
in the ``proxy`` package; install it first (``pip install -e .`` or ``make test``).
"""

from proxy.addon import CrossTalk
from proxy.guards import CrossTalkDegenerate, CrossTalkPrevention
from proxy.metrics import CrossTalkMetrics

# In this order: the others read CrossTalk's per-flow state (README "Metrics",
# "Prevention: cache_salt and canaries", "Degenerate output").
addons = [CrossTalk(), CrossTalkPrevention(), CrossTalkDegenerate(), CrossTalkMetrics()]
