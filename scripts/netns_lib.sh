# Emulated hosts for the benchmarks (source it; needs root, ip netns and tc): N network
# namespaces ${NETNS_PREFIX}0.., each with a veth pair to one bridge ${NETNS_PREFIX}-br and
# the address ${NETNS_SUBNET}.(i+1), the namespace's side of each link shaped by tc.
#
#   NETNS_PREFIX (default flt), NETNS_SUBNET (default 10.77.0): pick others to run two
#   benchmarks side by side. NETNS_MTU (default 1500): e.g. 9000 for jumbo frames.
#   netns_probe_netem          sets SHAPER=netem if the kernel has sch_netem, else SHAPER=htb
#   netns_setup N RATE [DELAY] builds the namespaces; RATE like 1gbit; with SHAPER=netem
#                              DELAY (default 1ms) each way, else an HTB class (rate only)
#   netns_teardown             removes them (safe to call twice; install it as an EXIT trap)
#   netns_addr I               the address of namespace I

NETNS_PREFIX=${NETNS_PREFIX:-flt}
NETNS_SUBNET=${NETNS_SUBNET:-10.77.0}
NETNS_MTU=${NETNS_MTU:-1500}
NETNS_COUNT=0

netns_addr() { echo "$NETNS_SUBNET.$(($1 + 1))"; }

netns_teardown() {
  local i
  for i in $(seq 0 $((NETNS_COUNT - 1))); do ip netns del "$NETNS_PREFIX$i" 2>/dev/null; done
  ip link del "$NETNS_PREFIX-br" 2>/dev/null
  true
}

netns_probe_netem() {
  local probe="$NETNS_PREFIX-probe"
  ip netns add "$probe" && ip -n "$probe" link set lo up
  if ip netns exec "$probe" tc qdisc add dev lo root netem delay 1ms 2>/dev/null; then
    SHAPER=netem
  else
    SHAPER=htb
  fi
  ip netns del "$probe"
}

netns_setup() { # count rate [delay]
  local n=$1 rate=$2 delay=${3:-1ms} i ns
  netns_teardown
  NETNS_COUNT=$n
  ip link add "$NETNS_PREFIX-br" type bridge && ip link set "$NETNS_PREFIX-br" up || return 1
  for i in $(seq 0 $((n - 1))); do
    ns=$NETNS_PREFIX$i
    ip netns add "$ns" || return 1
    ip link add "$NETNS_PREFIX-v$i" type veth peer name eth0 netns "$ns" || return 1
    ip link set "$NETNS_PREFIX-v$i" mtu "$NETNS_MTU" master "$NETNS_PREFIX-br" up
    ip -n "$ns" link set eth0 mtu "$NETNS_MTU"
    ip -n "$ns" addr add "$(netns_addr "$i")/24" dev eth0
    ip -n "$ns" link set eth0 up
    ip -n "$ns" link set lo up
    if [ "${SHAPER:-htb}" = netem ]; then
      ip netns exec "$ns" tc qdisc add dev eth0 root netem delay "$delay" rate "$rate" limit 100000
    else
      # Rate only: an HTB class with small bursts (a token bucket with a burst large enough
      # for 64 KiB GSO packets would let a whole step's traffic through at once).
      ip netns exec "$ns" tc qdisc add dev eth0 root handle 1: htb default 10 &&
        ip netns exec "$ns" tc class add dev eth0 parent 1: classid 1:10 htb rate "$rate" \
          ceil "$rate" burst 15k cburst 15k || return 1
    fi
  done
}
