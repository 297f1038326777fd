"""The homagg protocol and pipeline names, generated from the P4 program. Do not edit.

Made by homagg.controller.genconsts from p4/include/*.p4 (constants, the homagg_h field
list, enums) and the compiled P4Info (names and ids). Change the P4 source, then run
`homagg-ctl build` or `python -m homagg.controller.genconsts --p4info ...`.
"""

# fmt: off
# ---- constants (p4/include) ----
SLOT_INDEX_WIDTH = 10
SLOTS = 1024
SLOT_STATE_SIZE = 2048
MAX_WORKERS = 64
JOB_ID_WIDTH = 6
MAX_JOBS = 64
STATS_SIZE = 32
FWD_STATS_SIZE = 4
JOB_STATS_PER_JOB = 4
JOB_STATS_SIZE = 256
LOCAL_IP_TABLE_SIZE = 16
JOB_TABLE_SIZE = 1024
RESULT_TABLE_SIZE = 1024
ARP_TABLE_SIZE = 1024
ROUTE_TABLE_SIZE = 1024
HOMAGG_UDP_PORT_MIN = 48864
HOMAGG_UDP_PORT_MAX = 48879
HOMAGG_VERSION = 1
OP_ADD = 1
OP_OR = 2
FLAG_RESULT = 128
FLAG_OVERFLOW = 64
FLAG_PHASE = 32
FLAG_RETRANS = 16
FLAG_STATUS = 8
WORDS_PER_PACKET = 64
STATUS_WORD = 61
HOMAGG_HDR_BYTES = 12
HOMAGG_PAYLOAD_BYTES = 256
HOMAGG_UDP_LEN = 276
HOMAGG_IPV4_LEN = 296
STAT_RX = 0
STAT_ACCEPTED = 1
STAT_COMPLETED = 2
STAT_RETRANS_REPLY = 3
STAT_DUP_PENDING = 4
STAT_OVERFLOW = 5
DROP_MALFORMED = 6
DROP_BAD_LENGTH = 7
DROP_BAD_VERSION = 8
DROP_BAD_OP = 9
DROP_FORGED_RESULT = 10
DROP_UNKNOWN_SENDER = 11
DROP_WRONG_IDENTITY = 12
DROP_BAD_SLOT = 13
DROP_SEQ_MISMATCH = 14
DROP_STALE = 15
DROP_SPOOFED = 16
EPOCH_STORE = 31
FWD_ROUTED = 0
FWD_ARP_REPLIES = 1
FWD_NO_ROUTE = 2
FWD_SPOOFED = 3
JOB_STAT_ACCEPTED = 0
JOB_STAT_COMPLETED = 1
JOB_STAT_RETRANS = 2
JOB_STAT_DROPPED = 3
NO_DROP = 255
RID_WORKER_OFFSET = 1
WORDS_BITS = 2048
ETHERTYPE_IPV4 = 2048
ETHERTYPE_ARP = 2054
IP_PROTO_UDP = 17
ARP_OPER_REQUEST = 1
ARP_OPER_REPLY = 2

# ---- counter indices by counter array: index -> name ----
STATS: dict[int, str] = {0: 'STAT_RX',
 1: 'STAT_ACCEPTED',
 2: 'STAT_COMPLETED',
 3: 'STAT_RETRANS_REPLY',
 4: 'STAT_DUP_PENDING',
 5: 'STAT_OVERFLOW',
 6: 'DROP_MALFORMED',
 7: 'DROP_BAD_LENGTH',
 8: 'DROP_BAD_VERSION',
 9: 'DROP_BAD_OP',
 10: 'DROP_FORGED_RESULT',
 11: 'DROP_UNKNOWN_SENDER',
 12: 'DROP_WRONG_IDENTITY',
 13: 'DROP_BAD_SLOT',
 14: 'DROP_SEQ_MISMATCH',
 15: 'DROP_STALE',
 16: 'DROP_SPOOFED'}
FWD_STATS: dict[int, str] = {0: 'FWD_ROUTED', 1: 'FWD_ARP_REPLIES', 2: 'FWD_NO_ROUTE', 3: 'FWD_SPOOFED'}
JOB_STATS: dict[int, str] = {0: 'JOB_STAT_ACCEPTED', 1: 'JOB_STAT_COMPLETED', 2: 'JOB_STAT_RETRANS', 3: 'JOB_STAT_DROPPED'}

# ---- header homagg_h: (field, bits), first on the wire first ----
HEADER_FIELDS: tuple[tuple[str, int], ...] = (('version', 4), ('op', 4), ('flags', 8), ('job', 16), ('worker', 8), ('reserved', 8), ('slot', 16), ('seq', 32))

# ---- serializable enums: name -> member -> value ----
ENUMS: dict[str, dict[str, int]] = {'Verdict': {'ACCEPT': 0, 'RETRANS_REPLY': 1, 'DUP_PENDING': 2, 'SEQ_MISMATCH': 3, 'STALE': 4}}

# ---- P4Info: full names, ids, match fields and parameters ----
# (no P4Info given: compile with homagg-ctl build and regenerate)

TABLES: dict[str, dict] = {}
ACTIONS: dict[str, dict] = {}
COUNTERS: dict[str, dict] = {}
REGISTERS: dict[str, dict] = {}
# fmt: on
