#!/usr/bin/python3
"""Checks the ICRC of every RoCEv2 packet of a pcap file with an implementation that is not
softverbs': scapy's RoCE layer (scapy.contrib.roce, Debian's python3-scapy) over IPv4, and
over IPv6, which scapy's layer does not cover, the masking of IBA Annex A17 written out here
with zlib's CRC-32 (as crates/softverbs-roce/tests/icrc_oracle.rs does).

Usage: roce_icrc.py FILE.pcap   (pcap or pcapng; link types raw IP, Ethernet, Linux cooked)

Prints one JSON object per packet, in file order, then a summary object:
  {"frame": 1, "verdict": "match", "icrc": "1a2b3c4d", "computed": "1a2b3c4d"}
  {"frame": 2, "verdict": "mismatch", "icrc": "...", "computed": "..."}
  {"frame": 3, "verdict": "not_roce", "why": "not UDP port 4791"}
  {"checked": 3}
The ICRC is shown as it lies on the wire (its four bytes in order). Exit status 0 even with
mismatches (the caller judges); 2 if the file cannot be read.
"""

import json
import struct
import sys
import zlib

from scapy.contrib.roce import BTH
from scapy.layers.inet import IP, UDP
from scapy.packet import bind_layers
from scapy.utils import RawPcapReader

bind_layers(UDP, BTH, dport=4791)

ROCE_PORT = 4791


def icrc_v6(b):
    """Annex A17 over IPv6: variant fields masked to ones, then CRC-32 (little-endian)."""
    ip = bytearray(b[:40])
    ip[0] |= 0x0F
    ip[1:4] = b"\xff\xff\xff"
    ip[7] = 0xFF
    udp = bytearray(b[40:48])
    udp[6:8] = b"\xff\xff"
    rest = bytearray(b[48:-4])
    rest[4] = 0xFF
    return struct.pack("<I", zlib.crc32(b"\xff" * 8 + ip + udp + rest) & 0xFFFFFFFF)


def ip_datagram(linktype, frame):
    """The IP datagram in a link-layer frame, or None if there is none."""
    if linktype in (101, 12, 14, 228, 229):  # raw IP (and its aliases)
        return frame
    if linktype == 1:  # Ethernet, with any 802.1Q tags
        off, ethertype = 12, None
        while off + 2 <= len(frame):
            ethertype = struct.unpack("!H", frame[off : off + 2])[0]
            off += 2
            if ethertype not in (0x8100, 0x88A8):
                break
            off += 2
        return frame[off:] if ethertype in (0x0800, 0x86DD) else None
    if linktype == 113:  # Linux cooked capture v1
        return frame[16:] if frame[14:16] in (b"\x08\x00", b"\x86\xdd") else None
    if linktype == 276:  # Linux cooked capture v2
        return frame[20:] if frame[0:2] in (b"\x08\x00", b"\x86\xdd") else None
    return None


def check(b):
    """(verdict, fields) of one IP datagram."""
    if len(b) < 1:
        return "not_roce", {"why": "empty"}
    version = b[0] >> 4
    if version == 4:
        if len(b) < 20:
            return "not_roce", {"why": "short IPv4 header"}
        total = struct.unpack("!H", b[2:4])[0]
        ihl = (b[0] & 0x0F) * 4
        b = b[:total]  # drop Ethernet padding
        if b[9] != 17 or len(b) < ihl + 8 + 12 + 4:
            return "not_roce", {"why": "not UDP, or too short for BTH and ICRC"}
        if struct.unpack("!H", b[ihl + 2 : ihl + 4])[0] != ROCE_PORT:
            return "not_roce", {"why": "not UDP port 4791"}
        p = IP(b)
        if BTH not in p:
            return "not_roce", {"why": "scapy found no BTH"}
        computed = p[BTH].compute_icrc(None)
    elif version == 6:
        if len(b) < 40:
            return "not_roce", {"why": "short IPv6 header"}
        b = b[: 40 + struct.unpack("!H", b[4:6])[0]]
        if b[6] != 17 or len(b) < 48 + 12 + 4:
            return "not_roce", {"why": "not UDP, or too short for BTH and ICRC"}
        if struct.unpack("!H", b[42:44])[0] != ROCE_PORT:
            return "not_roce", {"why": "not UDP port 4791"}
        computed = icrc_v6(b)
    else:
        return "not_roce", {"why": "IP version %d" % version}
    fields = {"icrc": b[-4:].hex(), "computed": computed.hex()}
    return ("match" if computed == b[-4:] else "mismatch"), fields


def main():
    if len(sys.argv) != 2:
        print("usage: roce_icrc.py FILE.pcap", file=sys.stderr)
        return 2
    try:
        reader = RawPcapReader(sys.argv[1])
    except (OSError, Exception) as e:  # scapy raises Scapy_Exception for a bad file
        print("cannot read %s: %s" % (sys.argv[1], e), file=sys.stderr)
        return 2
    linktype = getattr(reader, "linktype", 101)
    checked = 0
    for frame, meta in reader:
        checked += 1
        wirelen = getattr(meta, "wirelen", None)
        if wirelen is not None and wirelen > len(frame):
            verdict, fields = "not_roce", {"why": "truncated by the capture's snaplen"}
        else:
            datagram = ip_datagram(linktype, frame)
            if datagram is None:
                verdict, fields = "not_roce", {"why": "no IP datagram (link type %d)" % linktype}
            else:
                verdict, fields = check(bytes(datagram))
        print(json.dumps(dict(frame=checked, verdict=verdict, **fields)))
    print(json.dumps({"checked": checked}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
