"""The homagg protocol and pipeline names, generated from the P4 program. Do not edit.

Made by homagg.controller.genconsts from p4/include/*.p4 (constants, the homagg_h field
list, enums) and the compiled P4Info (names and ids). Change the P4 source, then run
`homagg-ctl build` or `python -m homagg.controller.genconsts --p4info ...`.
"""

import enum

from homagg.p4schema import (P4Action, P4ActionParam, P4Counter, P4MatchField,
                             P4Register, P4Schema, P4Table)

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
PARENT_TABLE_SIZE = 64
HOMAGG_UDP_PORT_MIN = 48864
HOMAGG_UDP_PORT_MAX = 48879
HOMAGG_VERSION = 2
OP_ADD = 1
OP_OR = 2
OP_JOIN = 3
FLAG_RESULT = 128
FLAG_OVERFLOW = 64
FLAG_PHASE = 32
FLAG_RETRANS = 16
FLAG_STATUS = 8
FLAG_REFUSED = 4
FLAG_UPSTREAM = 2
WORDS_PER_PACKET = 256
DEFAULT_MTU = 1500
JUMBO_MTU = 9000
MAX_WORDS_PER_PACKET = 2239
MIN_WORDS_PER_PACKET = 16
STATUS_WORD = 253
HOMAGG_HDR_BYTES = 16
HOMAGG_PAYLOAD_BYTES = 1024
HOMAGG_UDP_LEN = 1048
HOMAGG_IPV4_LEN = 1068
JOIN_WORDS = 16
JOIN_RUN_WORD = 0
HOMAGG_JOIN_UDP_LEN = 88
HOMAGG_JOIN_IPV4_LEN = 108
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
STAT_PARTIAL_UP = 17
STAT_PARTIAL_RESENT = 18
STAT_FROM_PARENT = 19
DROP_PARENT_DUP = 20
STAT_JOIN_AFRESH = 21
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
CHUNK_WORDS = 64
CHUNK_BITS = 2048
WORD_CHUNKS = 4
WORDS_BITS = 8192
SLOT_COPY_BITS = 136
SEEN_HI = 135
SEEN_LO = 72
COUNT_HI = 71
COUNT_LO = 64
TAG_HI = 63
TAG_LO = 32
OP_HI = 31
OP_LO = 28
EPOCH_HI = 27
EPOCH_LO = 12
GEN_HI = 11
GEN_LO = 4
FINAL_BIT = 3
JOIN_BITS = 138
JOIN_RUN_HI = 137
JOIN_RUN_LO = 106
JOIN_SEEN_HI = 105
JOIN_SEEN_LO = 42
JOIN_COUNT_HI = 41
JOIN_COUNT_LO = 34
JOIN_GEN_HI = 33
JOIN_GEN_LO = 26
JOIN_EPOCH_HI = 25
JOIN_EPOCH_LO = 10
JOIN_HANDED_HI = 9
JOIN_HANDED_LO = 2
JOIN_HELD = 1
JOIN_FINAL = 0
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
 16: 'DROP_SPOOFED',
 17: 'STAT_PARTIAL_UP',
 18: 'STAT_PARTIAL_RESENT',
 19: 'STAT_FROM_PARENT',
 20: 'DROP_PARENT_DUP',
 21: 'STAT_JOIN_AFRESH'}
FWD_STATS: dict[int, str] = {0: 'FWD_ROUTED', 1: 'FWD_ARP_REPLIES', 2: 'FWD_NO_ROUTE', 3: 'FWD_SPOOFED'}
JOB_STATS: dict[int, str] = {0: 'JOB_STAT_ACCEPTED',
 1: 'JOB_STAT_COMPLETED',
 2: 'JOB_STAT_RETRANS',
 3: 'JOB_STAT_DROPPED'}

# ---- header homagg_h: (field, bits), first on the wire first ----
HEADER_FIELDS: tuple[tuple[str, int], ...] = (('version', 4), ('op', 4), ('flags', 8), ('job', 16), ('worker', 8), ('gen', 8), ('slot', 16), ('seq', 32), ('auth', 32))

# ---- serializable enums: name -> member -> value ----
ENUMS: dict[str, dict[str, int]] = {'Verdict': {'ACCEPT': 0,
             'RETRANS_REPLY': 1,
             'DUP_PENDING': 2,
             'SEQ_MISMATCH': 3,
             'STALE': 4,
             'RESEND_UP': 5}}


class Verdict(enum.IntEnum):
    ACCEPT = 0
    RETRANS_REPLY = 1
    DUP_PENDING = 2
    SEQ_MISMATCH = 3
    STALE = 4
    RESEND_UP = 5


# ---- P4Info: full names, ids, match fields and parameters ----
TABLE_ARP_PROXY = 'HomaggIngress.forwarding.arp_proxy'
TABLE_IPV4_ROUTE = 'HomaggIngress.forwarding.ipv4_route'
TABLE_AGGREGATORS = 'HomaggIngress.forwarding.aggregators'
TABLE_PARENTS = 'HomaggIngress.aggregation.admission.parents'
TABLE_JOB_WORKERS = 'HomaggIngress.aggregation.admission.job_workers'
TABLE_UPLINK = 'HomaggIngress.aggregation.uplink.uplink'
TABLE_LOCAL_IP = 'HomaggIngress.local_ip'
TABLE_RESULT_DST = 'HomaggEgress.result_addressing.result_dst'
ACTION_NOACTION = 'NoAction'
ACTION_ARP_REPLY = 'HomaggIngress.forwarding.arp_reply'
ACTION_ROUTE = 'HomaggIngress.forwarding.route'
ACTION_TRUSTED = 'HomaggIngress.forwarding.trusted'
ACTION_SET_WORKER = 'HomaggIngress.aggregation.admission.set_worker'
ACTION_SET_PARENT = 'HomaggIngress.aggregation.admission.set_parent'
ACTION_FIRST_WORDS = 'HomaggIngress.aggregation.words.first_words'
ACTION_KEEP_FINAL = 'HomaggIngress.aggregation.words.keep_final'
ACTION_MERGE_OVERFLOW = 'HomaggIngress.aggregation.words.merge_overflow'
ACTION_ADD_WORDS = 'HomaggIngress.aggregation.words.add_words'
ACTION_ADD_WORDS_EMIT = 'HomaggIngress.aggregation.words.add_words_emit'
ACTION_OR_WORDS = 'HomaggIngress.aggregation.words.or_words'
ACTION_OR_WORDS_EMIT = 'HomaggIngress.aggregation.words.or_words_emit'
ACTION_READ_RESULT = 'HomaggIngress.aggregation.words.read_result'
ACTION_FROM_SWITCH = 'HomaggIngress.aggregation.reply.from_switch'
ACTION_TO_SENDER = 'HomaggIngress.aggregation.reply.to_sender'
ACTION_TO_PARENT = 'HomaggIngress.aggregation.reply.to_parent'
ACTION_SET_UPLINK = 'HomaggIngress.aggregation.uplink.set_uplink'
ACTION_JOB_COUNT = 'HomaggIngress.aggregation.job_count'
ACTION_TO_SWITCH = 'HomaggIngress.to_switch'
ACTION_SET_RESULT_DST = 'HomaggEgress.result_addressing.set_result_dst'
ACTION_DROP_REPLICA = 'HomaggEgress.result_addressing.drop_replica'
COUNTER_FWD_STATS = 'HomaggIngress.forwarding.fwd_stats'
COUNTER_STATS = 'HomaggIngress.aggregation.stats'
COUNTER_JOB_STATS = 'HomaggIngress.aggregation.job_stats'
REGISTER_JOIN_STATE = 'HomaggIngress.aggregation.join.join_state'
REGISTER_JOIN_NONCE = 'HomaggIngress.aggregation.join.join_nonce'
REGISTER_SLOT_STATE = 'HomaggIngress.aggregation.slot_state.slot_state'
REGISTER_SLOT_WORDS0 = 'HomaggIngress.aggregation.words.slot_words0'
REGISTER_SLOT_WORDS1 = 'HomaggIngress.aggregation.words.slot_words1'
REGISTER_SLOT_WORDS2 = 'HomaggIngress.aggregation.words.slot_words2'
REGISTER_SLOT_WORDS3 = 'HomaggIngress.aggregation.words.slot_words3'
REGISTER_SLOT_OVERFLOW = 'HomaggIngress.aggregation.words.slot_overflow'

SCHEMA: P4Schema = P4Schema(tables=(P4Table(name='HomaggIngress.forwarding.arp_proxy',
                         id=46778369,
                         match_fields=(P4MatchField(name='tpa',
                                                    id=1,
                                                    bitwidth=32,
                                                    match_type='exact'),),
                         action_ids=(23026197, 21257015),
                         size=1024),
                 P4Table(name='HomaggIngress.forwarding.ipv4_route',
                         id=47762615,
                         match_fields=(P4MatchField(name='dst_addr',
                                                    id=1,
                                                    bitwidth=32,
                                                    match_type='lpm'),),
                         action_ids=(28901978, 21257015),
                         size=1024),
                 P4Table(name='HomaggIngress.forwarding.aggregators',
                         id=36158273,
                         match_fields=(P4MatchField(name='src_addr',
                                                    id=1,
                                                    bitwidth=32,
                                                    match_type='exact'),
                                       P4MatchField(name='port',
                                                    id=2,
                                                    bitwidth=9,
                                                    match_type='exact')),
                         action_ids=(31068107, 21257015),
                         size=16),
                 P4Table(name='HomaggIngress.aggregation.admission.parents',
                         id=44515412,
                         match_fields=(P4MatchField(name='src_addr',
                                                    id=1,
                                                    bitwidth=32,
                                                    match_type='exact'),
                                       P4MatchField(name='src_port',
                                                    id=2,
                                                    bitwidth=16,
                                                    match_type='exact'),
                                       P4MatchField(name='parent_job',
                                                    id=3,
                                                    bitwidth=16,
                                                    match_type='exact'),
                                       P4MatchField(name='parent_auth',
                                                    id=4,
                                                    bitwidth=32,
                                                    match_type='exact')),
                         action_ids=(32922292, 21257015),
                         size=64),
                 P4Table(name='HomaggIngress.aggregation.admission.job_workers',
                         id=43387275,
                         match_fields=(P4MatchField(name='src_addr',
                                                    id=1,
                                                    bitwidth=32,
                                                    match_type='exact'),
                                       P4MatchField(name='src_port',
                                                    id=2,
                                                    bitwidth=16,
                                                    match_type='exact')),
                         action_ids=(28042185, 21257015),
                         size=1024),
                 P4Table(name='HomaggIngress.aggregation.uplink.uplink',
                         id=36720590,
                         match_fields=(P4MatchField(name='job',
                                                    id=1,
                                                    bitwidth=16,
                                                    match_type='exact'),),
                         action_ids=(26515050, 21257015),
                         size=64),
                 P4Table(name='HomaggIngress.local_ip',
                         id=46086682,
                         match_fields=(P4MatchField(name='dst_addr',
                                                    id=1,
                                                    bitwidth=32,
                                                    match_type='exact'),),
                         action_ids=(32762413, 21257015),
                         size=16),
                 P4Table(name='HomaggEgress.result_addressing.result_dst',
                         id=39172084,
                         match_fields=(P4MatchField(name='job',
                                                    id=1,
                                                    bitwidth=16,
                                                    match_type='exact'),
                                       P4MatchField(name='rid',
                                                    id=2,
                                                    bitwidth=16,
                                                    match_type='exact')),
                         action_ids=(21954054, 17611450),
                         size=1024)),
         actions=(P4Action(name='NoAction', id=21257015, params=()),
                  P4Action(name='HomaggIngress.forwarding.arp_reply',
                           id=23026197,
                           params=(P4ActionParam(name='mac',
                                                 id=1,
                                                 bitwidth=48),)),
                  P4Action(name='HomaggIngress.forwarding.route',
                           id=28901978,
                           params=(P4ActionParam(name='port', id=1, bitwidth=9),
                                   P4ActionParam(name='src_mac',
                                                 id=2,
                                                 bitwidth=48),
                                   P4ActionParam(name='dst_mac',
                                                 id=3,
                                                 bitwidth=48))),
                  P4Action(name='HomaggIngress.forwarding.trusted',
                           id=31068107,
                           params=()),
                  P4Action(name='HomaggIngress.aggregation.admission.set_worker',
                           id=28042185,
                           params=(P4ActionParam(name='job', id=1, bitwidth=16),
                                   P4ActionParam(name='worker',
                                                 id=2,
                                                 bitwidth=8),
                                   P4ActionParam(name='workers',
                                                 id=3,
                                                 bitwidth=8),
                                   P4ActionParam(name='epoch',
                                                 id=4,
                                                 bitwidth=16),
                                   P4ActionParam(name='region_base',
                                                 id=5,
                                                 bitwidth=16),
                                   P4ActionParam(name='region_size',
                                                 id=6,
                                                 bitwidth=16),
                                   P4ActionParam(name='mcast_group',
                                                 id=7,
                                                 bitwidth=16),
                                   P4ActionParam(name='port', id=8, bitwidth=9),
                                   P4ActionParam(name='auth',
                                                 id=9,
                                                 bitwidth=32))),
                  P4Action(name='HomaggIngress.aggregation.admission.set_parent',
                           id=32922292,
                           params=(P4ActionParam(name='job', id=1, bitwidth=16),
                                   P4ActionParam(name='workers',
                                                 id=2,
                                                 bitwidth=8),
                                   P4ActionParam(name='epoch',
                                                 id=3,
                                                 bitwidth=16),
                                   P4ActionParam(name='region_base',
                                                 id=4,
                                                 bitwidth=16),
                                   P4ActionParam(name='region_size',
                                                 id=5,
                                                 bitwidth=16),
                                   P4ActionParam(name='mcast_group',
                                                 id=6,
                                                 bitwidth=16),
                                   P4ActionParam(name='port', id=7, bitwidth=9),
                                   P4ActionParam(name='auth',
                                                 id=8,
                                                 bitwidth=32))),
                  P4Action(name='HomaggIngress.aggregation.words.first_words',
                           id=32712911,
                           params=()),
                  P4Action(name='HomaggIngress.aggregation.words.keep_final',
                           id=21381883,
                           params=()),
                  P4Action(name='HomaggIngress.aggregation.words.merge_overflow',
                           id=22662305,
                           params=()),
                  P4Action(name='HomaggIngress.aggregation.words.add_words',
                           id=20455334,
                           params=()),
                  P4Action(name='HomaggIngress.aggregation.words.add_words_emit',
                           id=27680961,
                           params=()),
                  P4Action(name='HomaggIngress.aggregation.words.or_words',
                           id=32831940,
                           params=()),
                  P4Action(name='HomaggIngress.aggregation.words.or_words_emit',
                           id=20183848,
                           params=()),
                  P4Action(name='HomaggIngress.aggregation.words.read_result',
                           id=28358244,
                           params=()),
                  P4Action(name='HomaggIngress.aggregation.reply.from_switch',
                           id=24461643,
                           params=()),
                  P4Action(name='HomaggIngress.aggregation.reply.to_sender',
                           id=22346923,
                           params=()),
                  P4Action(name='HomaggIngress.aggregation.reply.to_parent',
                           id=29373596,
                           params=()),
                  P4Action(name='HomaggIngress.aggregation.uplink.set_uplink',
                           id=26515050,
                           params=(P4ActionParam(name='job', id=1, bitwidth=16),
                                   P4ActionParam(name='worker',
                                                 id=2,
                                                 bitwidth=8),
                                   P4ActionParam(name='mac', id=3, bitwidth=48),
                                   P4ActionParam(name='ip', id=4, bitwidth=32),
                                   P4ActionParam(name='udp_port',
                                                 id=5,
                                                 bitwidth=16),
                                   P4ActionParam(name='src_port',
                                                 id=6,
                                                 bitwidth=16),
                                   P4ActionParam(name='port', id=7, bitwidth=9),
                                   P4ActionParam(name='auth',
                                                 id=8,
                                                 bitwidth=32))),
                  P4Action(name='HomaggIngress.aggregation.job_count',
                           id=28004196,
                           params=()),
                  P4Action(name='HomaggIngress.to_switch',
                           id=32762413,
                           params=()),
                  P4Action(name='HomaggEgress.result_addressing.set_result_dst',
                           id=21954054,
                           params=(P4ActionParam(name='mac', id=1, bitwidth=48),
                                   P4ActionParam(name='ip', id=2, bitwidth=32),
                                   P4ActionParam(name='port',
                                                 id=3,
                                                 bitwidth=16))),
                  P4Action(name='HomaggEgress.result_addressing.drop_replica',
                           id=17611450,
                           params=())),
         counters=(P4Counter(name='HomaggIngress.forwarding.fwd_stats',
                             id=305495350,
                             size=4),
                   P4Counter(name='HomaggIngress.aggregation.stats',
                             id=312638953,
                             size=32),
                   P4Counter(name='HomaggIngress.aggregation.job_stats',
                             id=303283064,
                             size=256)),
         registers=(P4Register(name='HomaggIngress.aggregation.join.join_state',
                               id=374104814,
                               size=64),
                    P4Register(name='HomaggIngress.aggregation.join.join_nonce',
                               id=381645099,
                               size=4096),
                    P4Register(name='HomaggIngress.aggregation.slot_state.slot_state',
                               id=383259923,
                               size=1024),
                    P4Register(name='HomaggIngress.aggregation.words.slot_words0',
                               id=383889298,
                               size=2048),
                    P4Register(name='HomaggIngress.aggregation.words.slot_words1',
                               id=373589080,
                               size=2048),
                    P4Register(name='HomaggIngress.aggregation.words.slot_words2',
                               id=381089567,
                               size=2048),
                    P4Register(name='HomaggIngress.aggregation.words.slot_words3',
                               id=376490643,
                               size=2048),
                    P4Register(name='HomaggIngress.aggregation.words.slot_overflow',
                               id=377154927,
                               size=2048)))
# fmt: on
