"""The wire between pollen's ServerApp and ClientApp: every record, config,
metric and state key both sides use, spelled once.

A Flower message carries a `RecordDict`; pollen's records in it are named
below. The server's messages carry the shared model entries (`ARRAYS`) and a
`CONFIG` record naming the client (`CLIENT`), the round and the learning
rate; a client's reply carries its entries, its `METRICS` and a `CLIENT_RECORD`
repeating which client it answers for. Client state between rounds lives in
`context.state` under per-client keys. This module imports nothing heavier
than the standard library, so a ClientApp never imports the server's code.
"""

from __future__ import annotations

# ---- records of a message --------------------------------------------------
ARRAYS = "arrays"  # ArrayRecord: the model entries that travel
CONFIG = "config"  # ConfigRecord: what the server asks of this message
METRICS = "metrics"  # MetricRecord: what the client reports
CLIENT_RECORD = "client"  # ConfigRecord {CLIENT: k} in a reply
# SCAFFOLD's control variates (ArrayRecord over the trained shared entries):
# the server's c in a training message, the client's change Delta c_k in its reply
CONTROL = "control"
# FedProto's prototypes (ArrayRecord): in a training message the server's
# global ones (PROTOTYPE_CENTERS, one row per class, and PROTOTYPE_KNOWN, 1
# for a class some client has reported), in its reply the client's per-class
# sums and counts of its representations (PROTOTYPE_SUMS, PROTOTYPE_COUNTS)
PROTOTYPES = "prototypes"
PROTOTYPE_CENTERS = "centers"
PROTOTYPE_KNOWN = "known"
PROTOTYPE_SUMS = "sums"
PROTOTYPE_COUNTS = "counts"
NODE_RECORD = "node"  # ConfigRecord: a node's answer to the start-up query
# secure aggregation (pollen.common.secagg): the protocol's own values in every
# stage's message and reply, and the masked vector of a secure training reply
SECAGG = "secagg"  # ConfigRecord
# the next round's keys (with a training message) or shares (with an unmask
# message), set up ahead while this round runs: a stage-1 or stage-2 record
SECAGG_NEXT = "secagg-next"  # ConfigRecord
MASKED = "masked"  # ArrayRecord {MASKED: uint32 vector}
# the actions of the protocol's query messages ("query.<action>"), in order;
# its third stage is the training message itself, carrying a SECAGG record
SECAGG_KEYS = "secagg_keys"  # advertise two public keys
SECAGG_SHARES = "secagg_shares"  # share the two secrets, encrypted per holder
SECAGG_UNMASK = "secagg_unmask"  # reveal the shares that unmask the sum

# ---- config keys (server -> client) -----------------------------------------
CLIENT = "partition-id"  # the client (data partition) a message is for
SERVER_ROUND = "server-round"
CLIP_NORM = "clip-norm"  # central DP clipped on the client: this round's C
LR = "lr"  # this round's client learning rate

# ---- node config and the start-up query's answer (client -> server) ---------
NUM_PARTITIONS = "num-partitions"
DATA_ROOT = "data-root"  # node config: where this node finds the run's data set
DATA_FILE = "data-file"  # node config: a .npz of this node's own examples
STATE_DIR = (
    "state-dir"  # node config (wins) or server config: where client state is kept
)
NUM_EXAMPLES = "num-examples"  # also the weight of a training reply
OWN_DATA = "own-data"  # the node trains on its own data file
SHARD_FINGERPRINT = "shard-fingerprint"
# a straggler's compute slowdown (network profiles): local work takes this
# many times as long (node config; 1 when absent)
SLOWDOWN = "slowdown"
# every key a node reads of its node config (with CLIENT, the partition it serves)
NODE_CONFIG_KEYS = (CLIENT, NUM_PARTITIONS, DATA_ROOT, DATA_FILE, STATE_DIR, SLOWDOWN)

# ---- metrics (client -> server) ---------------------------------------------
TRAIN_LOSS = "train-loss"
# seconds of local training, measured before any straggler's slowdown (the
# simulated clock multiplies it by the profile's slowdown)
TRAIN_SECONDS = "train-seconds"
# seconds of a personal evaluation's work, likewise (the clock times it too)
EVAL_SECONDS = "eval-seconds"
# the SGD steps of this round's local training, and FedNova's a_k: their
# effective number under momentum and a pull towards the received model
LOCAL_STEPS = "local-steps"
EFFECTIVE_STEPS = "effective-steps"
UPDATE_NORM = "update-norm"  # central DP: the client's update norm before clipping
DP_EPSILON = "dp-epsilon"  # the privacy spent so far (DP-SGD)
DP_NOISE_MULTIPLIER = "dp-noise-multiplier"
DP_SAMPLE_RATE = "dp-sample-rate"  # q, each example's chance to be in a batch
DP_STEPS = "dp-steps"  # DP-SGD steps taken over every round so far
PERSONAL_METRICS = ("global-accuracy", "global-loss", "local-accuracy", "local-loss")


# ---- context.state keys (one client's state on its node) --------------------
def local_entries_key(client: int) -> str:
    """The model entries a sharing policy keeps on the client."""
    return f"local-{client}"


def ditto_state_key(client: int) -> str:
    """Ditto's personal model v_k (every state-dict entry)."""
    return f"ditto-{client}"


def scaffold_state_key(client: int) -> str:
    """SCAFFOLD's client control variate c_k."""
    return f"scaffold-c-{client}"


def feddyn_state_key(client: int) -> str:
    """FedDyn's gradient state h_k."""
    return f"feddyn-h-{client}"


def apfl_state_key(client: int) -> str:
    """APFL's personal model v_i (every state-dict entry) and, beside it
    (`apfl_alpha_key`), its mixing weight alpha_i."""
    return f"apfl-v-{client}"


def apfl_alpha_key(client: int) -> str:
    """APFL's mixing weight alpha_i (a config record, key "alpha")."""
    return f"apfl-alpha-{client}"


def fedala_state_key(client: int) -> str:
    """FedALA's previous model theta_i (every state-dict entry)."""
    return f"fedala-model-{client}"


def fedala_weights_key(client: int) -> str:
    """FedALA's aggregation weights W_i (one tensor per higher parameter)."""
    return f"fedala-weights-{client}"


def fedrod_head_key(client: int) -> str:
    """FedRoD's personal head h_P (the classifier's entries: weight, bias)."""
    return f"fedrod-head-{client}"


def moon_state_key(client: int) -> str:
    """MOON's previous local model w_k^{t-1} (every state-dict entry)."""
    return f"moon-{client}"


def secagg_state_key(client: int, server_round: int) -> str:
    """A secure round's secrets and the shares a client holds, for that round
    only: named outside the `<name>-<client>` form, so the client-state store
    (`pollen.task.client_state`) never writes, spills or restores them."""
    return f"secagg/{client}/{server_round}"


def dp_steps_key(client: int) -> str:
    """The DP-SGD steps a client's privacy accountant has counted."""
    return f"dp-steps-{client}"
