"""homagg: in-network aggregation of losslessly, homomorphically compressed gradients.

One import namespace for the whole project. The core (this package's own modules) holds what
every part shares: the wire protocol (``wire``, generated ``_p4consts``), the switch's rules
(``switch_model``), faults, errors, the network config schema, and the targets (software
aggregator, bmv2 process, veth testbed, toolchain discovery). Above it, and importing only it:
``homagg.controller`` (P4Runtime control plane), ``homagg.host_agent`` (agent, codec, DDP hook)
and ``homagg.launcher`` (Mininet). The folders controller/, host_agent/, launcher/ and p4/ at
the top of the checkout are those subpackages (homagg/ links to them).
"""

__version__ = "0.2.0"
