//! The ICRC checked by implementations that are not ours: every opcode over IPv4 against
//! scapy's RoCE layer (`scapy.contrib.roce`, Debian's `python3-scapy`), which computes the
//! ICRC from the packet's fields itself; over IPv6, which scapy's layer does not cover,
//! against the Annex A17 masking written out in Python with zlib's CRC-32.
//!
//! Without python3 and scapy the test is skipped with a message, except under `CI=true`,
//! where it fails.

use softverbs_roce::wire::*;
use std::io::Write;
use std::net::{Ipv4Addr, Ipv6Addr};
use std::process::{Command, Stdio};

const ORACLE: &str = r#"
import struct, sys, zlib
from scapy.layers.inet import IP
from scapy.packet import bind_layers
from scapy.layers.inet import UDP
from scapy.contrib.roce import BTH
bind_layers(UDP, BTH, dport=4791)

def icrc_v6(b):
    ip = bytearray(b[:40]); ip[0] |= 0x0f; ip[1:4] = b"\xff\xff\xff"; ip[7] = 0xff
    udp = bytearray(b[40:48]); udp[6:8] = b"\xff\xff"
    rest = bytearray(b[48:-4]); rest[4] = 0xff
    return struct.pack("<I", zlib.crc32(b"\xff" * 8 + ip + udp + rest) & 0xffffffff)

checked = 0
for line in sys.stdin:
    b = bytes.fromhex(line.strip())
    if b[0] >> 4 == 4:
        p = IP(b)
        if BTH not in p:
            print("NOT ROCE", line.strip()); continue
        want = p[BTH].compute_icrc(None)
    else:
        want = icrc_v6(b)
    if want != b[-4:]:
        print("MISMATCH", b[-4:].hex(), "oracle", want.hex(), line.strip())
    checked += 1
print("checked", checked)
"#;

fn packets() -> Vec<Vec<u8>> {
    let v4 = IpRepr::V4(Ipv4Repr {
        tos: 0x8a,
        ttl: 17,
        ident: 0x4242,
        ..Ipv4Repr::new(Ipv4Addr::new(192, 168, 7, 1), Ipv4Addr::new(192, 168, 7, 2))
    });
    let v6 = IpRepr::V6(Ipv6Repr {
        traffic_class: 0x68,
        flow_label: 0x9_abcd,
        hop_limit: 3,
        ..Ipv6Repr::new(
            Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, 1),
            Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, 2),
        )
    });
    let mut out = Vec::new();
    for (i, opcode) in Opcode::all().enumerate() {
        let op = opcode.op;
        let mut bth = Bth::new(
            opcode,
            0x00ab_0000 + i as u32,
            Psn::new(0xff_fff0 + i as u32),
        );
        bth.ack_req = i % 2 == 0;
        bth.solicited = i % 3 == 0;
        bth.becn = i % 5 == 0;
        let mut h = Headers::new(bth);
        if opcode.transport == Transport::Ud {
            h.deth = Some(Deth {
                qkey: 0x1111_1111,
                src_qp: 0x42,
            });
        }
        if opcode.transport == Transport::Xrc && op.is_request() {
            h.xrceth = Some(0x00c0_0000 + i as u32);
        }
        if op.has_reth() {
            h.reth = Some(Reth {
                va: 0x7f00_1234_5000,
                rkey: 0x1000 + i as u32,
                len: 4100,
            });
        }
        if op.is_atomic() {
            h.atomic_eth = Some(AtomicEth {
                va: 0x1000,
                rkey: 5,
                swap_add: 7,
                compare: 9,
            });
        }
        if op.has_aeth() {
            h.aeth = Some(Aeth::ack(i as u32));
        }
        if op == Op::AtomicAck {
            h.atomic_ack_eth = Some(AtomicAckEth {
                original: 0x0123_4567_89ab_cdef,
            });
        }
        if op.has_imm() {
            h.imm = Some(0xcafe_0000 + i as u32);
        }
        if op.has_ieth() {
            h.ieth = Some(0xbeef);
        }
        if op.has_feth() {
            h.feth = Some(0x11);
        }
        let payload: Vec<u8> = if op.has_payload() {
            (0..(i * 37 % 300) as u32)
                .map(|x| (x * 7 + 3) as u8)
                .collect()
        } else {
            Vec::new()
        };
        for ip in [v4, v6] {
            let mut buf = vec![0u8; 512];
            let n = emit_datagram(&ip, 0xc000 + i as u16, &h, &payload, &mut buf).unwrap();
            buf.truncate(n);
            out.push(buf);
        }
    }
    out
}

#[test]
fn icrc_matches_an_independent_implementation_for_every_opcode() {
    let ci = std::env::var("CI").as_deref() == Ok("true");
    // Debian's scapy is installed for Debian's python3, which another python3 on the PATH
    // (pyenv's, say) may hide.
    let python = ["/usr/bin/python3", "python3"].into_iter().find(|py| {
        Command::new(py)
            .args(["-c", "import scapy.contrib.roce"])
            .output()
            .is_ok_and(|o| o.status.success())
    });
    let Some(python) = python else {
        let msg =
            "python3 with scapy (apt-get install python3-scapy) is needed for the ICRC oracle";
        assert!(!ci, "{msg} (CI=true: not skipping)");
        eprintln!("SKIPPED: {msg}");
        return;
    };
    let packets = packets();
    let mut child = Command::new(python)
        .args(["-c", ORACLE])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("python3");
    {
        let mut stdin = child.stdin.take().expect("stdin");
        for p in &packets {
            let hex: String = p.iter().map(|b| format!("{b:02x}")).collect();
            writeln!(stdin, "{hex}").expect("write");
        }
    }
    let out = child.wait_with_output().expect("oracle");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        !text.contains("MISMATCH") && !text.contains("NOT ROCE"),
        "{text}"
    );
    assert!(
        text.contains(&format!("checked {}", packets.len())),
        "{text}"
    );
}
