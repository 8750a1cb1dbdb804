//! Classic libpcap files of simulated traffic, so a failing run can be opened in Wireshark or
//! tshark and read packet by packet with their RoCEv2 dissector (UDP port 4791).
//!
//! The link type is `LINKTYPE_RAW` (101): each record is the datagram exactly as a host
//! wrote it, starting at the IPv4 or IPv6 header, which readers tell apart by the version
//! nibble. Nothing in a record is parsed here, so any bytes a host produces can be captured.
//! Timestamps are the simulator's virtual time since its epoch (`Time(0)` is 1970-01-01 in
//! the file). The file is written little-endian whatever the platform, so the same run gives
//! the same bytes everywhere.
//!
//! ```
//! use softverbs_roce::Time;
//! use softverbs_roce::sim::pcap::{PcapWriter, Resolution};
//!
//! let mut pcap = PcapWriter::new(Vec::new(), Resolution::Nanos).unwrap();
//! pcap.write_record(Time(1_500), &[0x45, 0, 0, 20]).unwrap();
//! let bytes = pcap.into_inner();
//! assert_eq!(bytes.len(), 24 + 16 + 4);
//! ```

use std::io::{self, Write};

use crate::Time;

/// `LINKTYPE_RAW`: records start with an IPv4 or IPv6 header.
pub const LINKTYPE_RAW: u32 = 101;
/// Records longer than this are truncated in the file (their original length is kept):
/// libpcap's own maximum, beyond any datagram the simulator carries.
pub const SNAPLEN: u32 = 262_144;

/// The unit of the records' sub-second timestamps, chosen by the file's magic number.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Resolution {
    /// Magic 0xa1b2c3d4; virtual times are truncated to microseconds, which merges the
    /// nanosecond-apart events a fast simulated link produces. For very old readers only.
    Micros,
    /// Magic 0xa1b23c4d: exact virtual timestamps. Wireshark, tshark and tcpdump read it.
    Nanos,
}

impl Resolution {
    /// The magic number that announces this resolution.
    pub fn magic(self) -> u32 {
        match self {
            Resolution::Micros => 0xa1b2_c3d4,
            Resolution::Nanos => 0xa1b2_3c4d,
        }
    }
}

/// Writes a pcap file: the global header when created, then one record per datagram.
#[derive(Debug)]
pub struct PcapWriter<W: Write> {
    out: W,
    resolution: Resolution,
}

impl<W: Write> PcapWriter<W> {
    /// Starts a file on `out` by writing its 24-byte global header.
    pub fn new(mut out: W, resolution: Resolution) -> io::Result<PcapWriter<W>> {
        let mut header = [0u8; 24];
        header[0..4].copy_from_slice(&resolution.magic().to_le_bytes());
        header[4..6].copy_from_slice(&2u16.to_le_bytes()); // version 2.4
        header[6..8].copy_from_slice(&4u16.to_le_bytes());
        // thiszone and sigfigs: 0.
        header[16..20].copy_from_slice(&SNAPLEN.to_le_bytes());
        header[20..24].copy_from_slice(&LINKTYPE_RAW.to_le_bytes());
        out.write_all(&header)?;
        Ok(PcapWriter { out, resolution })
    }

    /// Appends one datagram seen at virtual time `at`.
    pub fn write_record(&mut self, at: Time, datagram: &[u8]) -> io::Result<()> {
        let secs = u32::try_from(at.0 / 1_000_000_000).unwrap_or(u32::MAX);
        let frac = at.0 % 1_000_000_000;
        let frac = match self.resolution {
            Resolution::Micros => frac / 1000,
            Resolution::Nanos => frac,
        } as u32;
        let orig_len = u32::try_from(datagram.len()).unwrap_or(u32::MAX);
        let incl_len = orig_len.min(SNAPLEN);
        let mut header = [0u8; 16];
        header[0..4].copy_from_slice(&secs.to_le_bytes());
        header[4..8].copy_from_slice(&frac.to_le_bytes());
        header[8..12].copy_from_slice(&incl_len.to_le_bytes());
        header[12..16].copy_from_slice(&orig_len.to_le_bytes());
        self.out.write_all(&header)?;
        self.out.write_all(&datagram[..incl_len as usize])
    }

    /// Flushes the underlying writer.
    pub fn flush(&mut self) -> io::Result<()> {
        self.out.flush()
    }

    /// The writer, e.g. to look at an in-memory capture.
    pub fn get_ref(&self) -> &W {
        &self.out
    }

    /// Ends the file and gives the writer back (unflushed: call [`flush`](Self::flush)
    /// first if it buffers).
    pub fn into_inner(self) -> W {
        self.out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn global_header_nanos_byte_by_byte() {
        let w = PcapWriter::new(Vec::new(), Resolution::Nanos).unwrap();
        assert_eq!(
            w.into_inner(),
            [
                0x4d, 0x3c, 0xb2, 0xa1, // magic, nanosecond timestamps
                0x02, 0x00, 0x04, 0x00, // version 2.4
                0x00, 0x00, 0x00, 0x00, // thiszone
                0x00, 0x00, 0x00, 0x00, // sigfigs
                0x00, 0x00, 0x04, 0x00, // snaplen 262144
                0x65, 0x00, 0x00, 0x00, // LINKTYPE_RAW
            ]
        );
    }

    #[test]
    fn records_byte_by_byte() {
        let mut w = PcapWriter::new(Vec::new(), Resolution::Micros).unwrap();
        // 2.000_123_456 s: micros keep 123.
        w.write_record(Time(2_000_123_456), &[0x45, 0xaa]).unwrap();
        w.write_record(Time(0), &[]).unwrap();
        let b = w.into_inner();
        assert_eq!(b[0..4], [0xd4, 0xc3, 0xb2, 0xa1]);
        assert_eq!(
            b[24..],
            [
                2, 0, 0, 0, // ts_sec
                123, 0, 0, 0, // ts_usec
                2, 0, 0, 0, // incl_len
                2, 0, 0, 0, // orig_len
                0x45, 0xaa, // data
                0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, // empty record
            ]
        );

        let mut w = PcapWriter::new(Vec::new(), Resolution::Nanos).unwrap();
        w.write_record(Time(2_000_123_456), &[1]).unwrap();
        let b = w.into_inner();
        assert_eq!(b[24..32], [2, 0, 0, 0, 0x40, 0xe2, 0x01, 0x00]);
    }

    #[test]
    fn oversized_records_are_truncated_and_far_times_saturate() {
        let mut w = PcapWriter::new(Vec::new(), Resolution::Nanos).unwrap();
        let big = vec![7u8; SNAPLEN as usize + 10];
        w.write_record(Time(u64::MAX), &big).unwrap();
        let b = w.into_inner();
        // u64::MAX ns is about 584 years: past u32 seconds, so the seconds saturate.
        assert_eq!(b[24..28], u32::MAX.to_le_bytes());
        assert_eq!(b[32..36], SNAPLEN.to_le_bytes());
        assert_eq!(b[36..40], (SNAPLEN + 10).to_le_bytes());
        assert_eq!(b.len(), 24 + 16 + SNAPLEN as usize);
    }

    #[test]
    fn write_errors_are_returned() {
        struct Full;
        impl Write for Full {
            fn write(&mut self, _: &[u8]) -> io::Result<usize> {
                Err(io::Error::other("disk full"))
            }
            fn flush(&mut self) -> io::Result<()> {
                Ok(())
            }
        }
        assert!(PcapWriter::new(Full, Resolution::Nanos).is_err());
    }
}
