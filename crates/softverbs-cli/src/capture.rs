//! Checks pcap captures of RoCEv2 traffic with tools that are not ours: Wireshark's
//! dissector (through `tshark`) must read every packet as InfiniBand over UDP port 4791
//! with a known opcode and nothing malformed, and scapy's RoCE layer must compute the ICRC
//! each packet carries.
//!
//! Our own parser agreeing with our own writer proves little; two independent readers
//! agreeing with the bytes on the wire is what "interoperable" means before there is a
//! second implementation to talk to. From a test:
//!
//! ```no_run
//! use softverbs_cli::capture;
//!
//! let Some(tools) = capture::tools_for_test("my capture test") else { return };
//! let summary = capture::check(&tools, "/tmp/run.pcap".as_ref()).expect("clean capture");
//! assert!(summary.opcodes.get("RC RDMA Write Only").copied().unwrap_or(0) > 0);
//! ```
//!
//! The ICRC half is `scripts/roce_icrc.py` (compiled in, and runnable by hand); it reads
//! pcap and pcapng files of raw IP, Ethernet and Linux cooked captures, so the same check
//! applies to the simulator's files and to `tcpdump -i svb -w` on a veth.

use serde::Deserialize;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// The ICRC checker, run by `python3 -c`.
const ICRC_SCRIPT: &str = include_str!("../../../scripts/roce_icrc.py");
/// `_ws.expert.severity` of an error (Wireshark's `PI_ERROR`).
const EXPERT_ERROR: u32 = 0x0080_0000;
/// The RoCEv2 UDP port.
const ROCE_PORT: u16 = 4791;

/// What went wrong checking a capture.
#[derive(Debug, thiserror::Error)]
pub enum CaptureError {
    /// A tool the check needs is not installed.
    #[error("`{tool}` not found ({hint})")]
    MissingTool {
        /// The program.
        tool: &'static str,
        /// How to install it.
        hint: &'static str,
    },
    /// A tool ran and failed (a file it cannot read, say).
    #[error("{tool} failed: {detail}")]
    Tool {
        /// The program.
        tool: String,
        /// Its exit status and standard error.
        detail: String,
    },
    /// A tool printed something this module does not understand.
    #[error("unexpected output from {tool}: {line}")]
    Output {
        /// The program.
        tool: &'static str,
        /// The line (or what was missing).
        line: String,
    },
    /// tshark found packets that are not clean RoCEv2.
    #[error("{} of {packets} packets are not clean RoCEv2: {}", problems.len(), show(problems))]
    Dissection {
        /// Packets in the file.
        packets: u64,
        /// What is wrong, packet by packet.
        problems: Vec<Problem>,
    },
    /// Packets whose ICRC is not the one scapy computes.
    #[error("{} of {checked} packets fail the ICRC check: {}", bad.len(), show(bad))]
    Icrc {
        /// Packets checked.
        checked: usize,
        /// The packets that failed.
        bad: Vec<IcrcPacket>,
    },
}

fn show<T: std::fmt::Debug>(items: &[T]) -> String {
    let mut s: Vec<String> = items.iter().take(8).map(|i| format!("{i:?}")).collect();
    if items.len() > 8 {
        s.push(format!("... ({} more)", items.len() - 8));
    }
    s.join("; ")
}

/// The programs the check runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tools {
    /// `tshark`.
    pub tshark: PathBuf,
    /// A python3 that can import `scapy.contrib.roce`.
    pub python: PathBuf,
}

/// Finds tshark and a python3 with scapy.
///
/// # Errors
///
/// [`CaptureError::MissingTool`] naming the first one missing.
pub fn find_tools() -> Result<Tools, CaptureError> {
    let tshark = std::env::var_os("PATH")
        .into_iter()
        .flat_map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .map(|d| d.join("tshark"))
        .find(|p| p.is_file())
        .ok_or(CaptureError::MissingTool {
            tool: "tshark",
            hint: "apt-get install tshark",
        })?;
    // Debian's scapy is installed for Debian's python3, which another python3 on the PATH
    // (pyenv's, say) may hide.
    let python = ["/usr/bin/python3", "python3"]
        .into_iter()
        .find(|py| {
            Command::new(py)
                .args(["-c", "import scapy.contrib.roce"])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success())
        })
        .ok_or(CaptureError::MissingTool {
            tool: "python3 with scapy",
            hint: "apt-get install python3-scapy",
        })?;
    Ok(Tools {
        tshark,
        python: PathBuf::from(python),
    })
}

/// For tests: the tools, or `None` after printing `SKIPPED: <test>: why`; under `CI=true`
/// a missing tool panics instead (a CI run must not skip).
pub fn tools_for_test(test: &str) -> Option<Tools> {
    match find_tools() {
        Ok(t) => Some(t),
        Err(e) => {
            let ci = std::env::var("CI").as_deref() == Ok("true");
            assert!(!ci, "{test}: {e} (CI=true: not skipping)");
            eprintln!("SKIPPED: {test}: {e}");
            None
        }
    }
}

/// Something wrong with one packet.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    /// The packet's number in the file, from 1 (as Wireshark shows it).
    pub frame: u64,
    /// What is wrong.
    pub what: String,
}

/// What tshark saw in a capture.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Dissection {
    /// Packets in the file.
    pub packets: u64,
    /// Packets by opcode, named as Wireshark names them (`"RC Send Only"`,
    /// `"RC RDMA Read Response First"`, `"RC Acknowledge"`, ...).
    pub opcodes: BTreeMap<String, u64>,
    /// Packets by BTH opcode number (`infiniband.bth.opcode`).
    pub opcode_numbers: BTreeMap<u8, u64>,
    /// Packets with an AETH by what it says: `ack`, `rnr` (RNR NAK), and the NAKs
    /// `psn_seq`, `invalid_request`, `remote_access`, `remote_op`, `invalid_rd`.
    pub naks: BTreeMap<String, u64>,
    /// Packets with an expert warning (reported, not a failure).
    pub warnings: u64,
    /// Packets that are not clean RoCEv2 (a failure for [`check`]).
    pub problems: Vec<Problem>,
}

/// The fields asked of tshark, in this order.
const FIELDS: [&str; 9] = [
    "frame.number",
    "frame.protocols",
    "udp.dstport",
    "infiniband.bth.opcode",
    "infiniband.aeth.syndrome.opcode",
    "infiniband.aeth.syndrome.error_code",
    "_ws.malformed",
    "_ws.expert.severity",
    "_ws.col.Info",
];

/// Runs tshark over `file` and sorts its packets: every one must be dissected as InfiniBand
/// over UDP 4791 (RRoCE), with a known opcode, and with no malformed-packet or expert
/// error; those that are not are listed in [`Dissection::problems`].
///
/// # Errors
///
/// tshark cannot run or cannot read the file, or prints what this does not understand.
pub fn dissect(tools: &Tools, file: &Path) -> Result<Dissection, CaptureError> {
    let mut cmd = Command::new(&tools.tshark);
    // RPC-over-RDMA guesses at SEND payloads; what the payload holds is not the question.
    cmd.args(["-n", "--disable-protocol", "rpcordma", "-r"])
        .arg(file)
        .args(["-T", "fields", "-E", "separator=/t", "-E", "occurrence=a"]);
    for f in FIELDS {
        cmd.args(["-e", f]);
    }
    let out = run(&mut cmd, "tshark")?;
    let mut d = Dissection::default();
    for line in out.lines().filter(|l| !l.trim().is_empty()) {
        let cols: Vec<&str> = line.split('\t').collect();
        if cols.len() != FIELDS.len() {
            return Err(CaptureError::Output {
                tool: "tshark",
                line: line.to_owned(),
            });
        }
        let frame: u64 = cols[0].parse().map_err(|_| CaptureError::Output {
            tool: "tshark",
            line: line.to_owned(),
        })?;
        d.packets += 1;
        let mut problem = |what: String| d.problems.push(Problem { frame, what });
        let protocols = cols[1];
        if !(protocols.contains("ip:udp:infiniband") || protocols.contains("ipv6:udp:infiniband")) {
            problem(format!("not dissected as RoCEv2 (protocols {protocols})"));
            continue;
        }
        if cols[2]
            .split(',')
            .next()
            .and_then(|p| p.parse::<u16>().ok())
            != Some(ROCE_PORT)
        {
            problem(format!("UDP destination port {} is not 4791", cols[2]));
        }
        // Wireshark guesses at what a SEND's payload holds ("IBA Payload - appears to be
        // EtherType encapsulated" when its third and fourth bytes are zero) and hands it to
        // that protocol, which may then find it malformed: a guess about the application's
        // bytes, not a fault of the packet. A malformed packet whose dissection went on
        // past InfiniBand is such a guess; one that stops at InfiniBand is a real problem.
        let payload_guess = protocols
            .split_once("infiniband")
            .is_some_and(|(_, rest)| rest.split(':').any(|p| !p.is_empty() && p != "data"));
        if !cols[6].is_empty() && !payload_guess {
            problem(format!("malformed: {}", cols[6]));
        }
        let severities: Vec<u32> = cols[7]
            .split(',')
            .filter_map(|s| s.trim().parse().ok())
            .collect();
        if severities.iter().any(|&s| s >= EXPERT_ERROR) && cols[6].is_empty() && !payload_guess {
            problem(format!("expert error ({})", cols[8].trim()));
        } else if !severities.is_empty() {
            d.warnings += 1;
        }
        let info = cols[8].trim();
        let Some(number) = cols[3].parse::<u8>().ok() else {
            problem(format!("no BTH opcode ({info})"));
            continue;
        };
        // Wireshark names the opcode at the head of the Info column ("RC Send Only
        // QP=0x000022"), and says "Unknown OpCode" for one it does not know.
        let name = info.split(" QP=").next().unwrap_or(info).trim();
        if name.starts_with("Unknown") || info.contains("Unknown OpCode") {
            problem(format!("unknown opcode {number} ({info})"));
            continue;
        }
        *d.opcode_numbers.entry(number).or_default() += 1;
        *d.opcodes.entry(name.to_owned()).or_default() += 1;
        // AETH syndrome: bits 7..5 say ACK (0), RNR NAK (1) or NAK (3, with an error code).
        if let Ok(kind) = cols[4].parse::<u8>() {
            let what = match (kind, cols[5].parse::<u8>().ok()) {
                (0, _) => "ack",
                (1, _) => "rnr",
                (3, Some(0)) => "psn_seq",
                (3, Some(1)) => "invalid_request",
                (3, Some(2)) => "remote_access",
                (3, Some(3)) => "remote_op",
                (3, Some(4)) => "invalid_rd",
                _ => "reserved",
            };
            *d.naks.entry(what.to_owned()).or_default() += 1;
        }
    }
    Ok(d)
}

/// scapy's verdict on one packet's ICRC.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// The ICRC in the packet is the one scapy computes.
    Match,
    /// It is not (both as they lie on the wire, first byte first).
    Mismatch {
        /// The packet's last four bytes.
        in_packet: [u8; 4],
        /// scapy's.
        computed: [u8; 4],
    },
    /// Not a RoCEv2 packet at all (why).
    NotRoce(String),
}

/// One packet's ICRC check.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IcrcPacket {
    /// The packet's number in the file, from 1.
    pub frame: u64,
    /// What scapy found.
    pub verdict: Verdict,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum ScriptLine {
    Packet {
        frame: u64,
        verdict: String,
        #[serde(default)]
        icrc: String,
        #[serde(default)]
        computed: String,
        #[serde(default)]
        why: String,
    },
    Summary {
        checked: u64,
    },
}

fn four_bytes(hex: &str) -> Option<[u8; 4]> {
    let v = u32::from_str_radix(hex, 16).ok()?;
    (hex.len() == 8).then(|| v.to_be_bytes())
}

/// Checks the ICRC of every packet in `file` with scapy (`scripts/roce_icrc.py`); one
/// entry per packet, in file order.
///
/// # Errors
///
/// python cannot run or cannot read the file, or its output is cut short.
pub fn check_icrc(tools: &Tools, file: &Path) -> Result<Vec<IcrcPacket>, CaptureError> {
    let mut cmd = Command::new(&tools.python);
    cmd.arg("-c").arg(ICRC_SCRIPT).arg(file);
    let out = run(&mut cmd, "roce_icrc.py")?;
    let bad = |line: &str| CaptureError::Output {
        tool: "roce_icrc.py",
        line: line.to_owned(),
    };
    let mut packets = Vec::new();
    let mut summary = None;
    for line in out.lines().filter(|l| !l.trim().is_empty()) {
        match serde_json::from_str::<ScriptLine>(line).map_err(|_| bad(line))? {
            ScriptLine::Summary { checked } => summary = Some(checked),
            ScriptLine::Packet {
                frame,
                verdict,
                icrc,
                computed,
                why,
            } => {
                let verdict = match verdict.as_str() {
                    "match" => Verdict::Match,
                    "mismatch" => Verdict::Mismatch {
                        in_packet: four_bytes(&icrc).ok_or_else(|| bad(line))?,
                        computed: four_bytes(&computed).ok_or_else(|| bad(line))?,
                    },
                    "not_roce" => Verdict::NotRoce(why),
                    _ => return Err(bad(line)),
                };
                packets.push(IcrcPacket { frame, verdict });
            }
        }
    }
    match summary {
        Some(n) if n == packets.len() as u64 => Ok(packets),
        _ => Err(bad(
            "(no summary line, or a count that does not match the packets)",
        )),
    }
}

/// Both checks: tshark's dissection and scapy's ICRC of every packet; the dissection when
/// both are clean.
///
/// # Errors
///
/// [`CaptureError::Dissection`] or [`CaptureError::Icrc`] listing the packets that fail,
/// or a tool's failure.
pub fn check(tools: &Tools, file: &Path) -> Result<Dissection, CaptureError> {
    let d = dissect(tools, file)?;
    if !d.problems.is_empty() {
        return Err(CaptureError::Dissection {
            packets: d.packets,
            problems: d.problems,
        });
    }
    let icrc = check_icrc(tools, file)?;
    if icrc.len() as u64 != d.packets {
        return Err(CaptureError::Output {
            tool: "roce_icrc.py",
            line: format!("{} packets, tshark saw {}", icrc.len(), d.packets),
        });
    }
    let checked = icrc.len();
    let bad: Vec<IcrcPacket> = icrc
        .into_iter()
        .filter(|p| p.verdict != Verdict::Match)
        .collect();
    if !bad.is_empty() {
        return Err(CaptureError::Icrc { checked, bad });
    }
    Ok(d)
}

/// Runs `cmd`; its standard output if it succeeds.
fn run(cmd: &mut Command, tool: &str) -> Result<String, CaptureError> {
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .map_err(|e| CaptureError::Tool {
            tool: tool.to_owned(),
            detail: format!("cannot start it: {e}"),
        })?;
    if !out.status.success() {
        let stderr = String::from_utf8_lossy(&out.stderr);
        // tshark warns that it runs as root; that is not the failure.
        let detail: Vec<&str> = stderr
            .lines()
            .filter(|l| !l.contains("could be dangerous") && !l.trim().is_empty())
            .collect();
        return Err(CaptureError::Tool {
            tool: tool.to_owned(),
            detail: format!("{}: {}", out.status, detail.join(" | ")),
        });
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}
