//! Device configuration: defaults, the builder's fields, and the `SOFTVERBS_DEVICES` syntax.
//!
//! `SOFTVERBS_DEVICES` lists devices separated by `;`, each a comma-separated list of
//! `key=value` pairs (every key optional):
//!
//! ```text
//! SOFTVERBS_DEVICES="name=softverbs0,link=eth,mtu=4096,gid=::ffff:127.0.0.1;name=sv1,link=ib,lid=7"
//! ```
//!
//! A networked device (RoCEv2 between hosts, see [`net`]) names its interface or address:
//! `name=roce0,netdev=eth0` or `name=roce0,ip=10.0.0.1`, with optional seeded faults on its
//! real path: `drop`, `dup`, `reorder`, `corrupt` (rates: `0.01` or `1%`), `delay_us`,
//! `fault_seed`. Its GIDs and MTU come from the interface (`mtu=` may lower the MTU).
//!
//! Keys: `name`, `link` (`eth`|`ib`), `mtu` (256..4096), `gid` (IPv6 text), `lid`,
//! `guid` (hex), `ts_bits` (completion timestamp width, 1..64), `ordering_check` (`0`/`1`:
//! scramble placement into relaxed-ordering MRs, see [`DeviceConfig::ordering_check`]), and
//! the limits `max_qp`,
//! `max_qp_wr`, `max_sge`, `max_cq`, `max_cqe`, `max_mr`, `max_mr_size`, `max_pd`,
//! `max_qp_rd_atom`, `max_srq`, `max_srq_wr`, `max_srq_sge`, `max_ah`, `max_inline_data`.

pub mod net;

use crate::error::{Error, Result};
use crate::types::{Gid, LinkLayer, Mtu};
pub use net::{Faults, NetConfig};

/// The environment variable that configures the software devices of a process.
pub const ENV_DEVICES: &str = "SOFTVERBS_DEVICES";

/// Resource limits a device enforces and reports through `query_device`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    pub max_qp: u32,
    pub max_qp_wr: u32,
    pub max_sge: u32,
    pub max_cq: u32,
    pub max_cqe: u32,
    pub max_mr: u32,
    pub max_mr_size: u64,
    pub max_pd: u32,
    pub max_qp_rd_atom: u32,
    pub max_srq: u32,
    pub max_srq_wr: u32,
    pub max_srq_sge: u32,
    pub max_ah: u32,
    pub max_inline_data: u32,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_qp: 65536,
            max_qp_wr: 16384,
            max_sge: 32,
            max_cq: 65536,
            max_cqe: 1 << 20,
            max_mr: 1 << 20,
            max_mr_size: 1 << 40,
            max_pd: 4096,
            max_qp_rd_atom: 16,
            max_srq: 65536,
            max_srq_wr: 16384,
            max_srq_sge: 32,
            max_ah: 65536,
            max_inline_data: 1024,
        }
    }
}

/// Everything that defines a software device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceConfig {
    pub name: String,
    pub link_layer: LinkLayer,
    pub active_mtu: Mtu,
    /// GID table entry 0.
    pub gid: Gid,
    /// Port LID (InfiniBand link layer; 0 on Ethernet).
    pub lid: u16,
    pub node_guid: u64,
    /// Width of the device clock in bits (`completion_timestamp_mask`).
    pub timestamp_bits: u32,
    /// The ordering check: writes into this device's relaxed-ordering MRs are placed in
    /// pieces in a scrambled order, final piece first, so a program that polls the last byte
    /// instead of waiting for the completion sees torn data in testing. Strict MRs are never
    /// scrambled. Off by default.
    pub ordering_check: bool,
    pub limits: Limits,
    /// The GID table: entry 0 is `gid` unless the device is networked, when it lists the
    /// interface's addresses in RoCE order (and `gid` is the primary address's entry).
    pub gid_table: Vec<Gid>,
    /// Set for a networked device: RoCEv2 over UDP between hosts.
    pub net: Option<NetConfig>,
}

impl Default for DeviceConfig {
    fn default() -> Self {
        DeviceConfig {
            name: "softverbs0".into(),
            link_layer: LinkLayer::Ethernet,
            active_mtu: Mtu::Mtu4096,
            // RoCEv2-style GID from the IPv4 loopback address.
            gid: Gid::from(
                "::ffff:127.0.0.1"
                    .parse::<std::net::Ipv6Addr>()
                    .expect("literal"),
            ),
            lid: 0,
            node_guid: 0x0250_56ff_fe00_0001,
            timestamp_bits: 48,
            ordering_check: false,
            limits: Limits::default(),
            gid_table: Vec::new(),
            net: None,
        }
    }
}

impl DeviceConfig {
    /// Parses a `SOFTVERBS_DEVICES` value. An empty value means one default device.
    pub fn parse_list(text: &str) -> Result<Vec<DeviceConfig>> {
        let specs: Vec<&str> = text
            .split(';')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .collect();
        if specs.is_empty() {
            return Ok(vec![DeviceConfig::default()]);
        }
        let mut out = Vec::new();
        for (i, spec) in specs.iter().enumerate() {
            let mut cfg = DeviceConfig::default();
            if i > 0 {
                // Later devices get distinct defaults so they are distinguishable on the fabric.
                cfg.name = format!("softverbs{i}");
                cfg.node_guid += i as u64;
                let mut gid = cfg.gid.0;
                gid[15] = gid[15].wrapping_add(i as u8);
                cfg.gid = Gid(gid);
            }
            for pair in spec.split(',').map(str::trim).filter(|s| !s.is_empty()) {
                let (k, v) = pair
                    .split_once('=')
                    .ok_or_else(|| Error::Config(format!("`{pair}` is not key=value")))?;
                cfg.set(k.trim(), v.trim())?;
            }
            if cfg.link_layer == LinkLayer::InfiniBand && cfg.lid == 0 {
                cfg.lid = 1 + i as u16;
            }
            cfg.resolve_net()?;
            cfg.validate()?;
            out.push(cfg);
        }
        Ok(out)
    }

    /// Sets one key as the environment syntax names it.
    pub fn set(&mut self, key: &str, value: &str) -> Result<()> {
        let bad = |what: &str| Error::Config(format!("{key}={value}: {what}"));
        let num = |v: &str| -> Result<u64> {
            let parsed = match v.strip_prefix("0x") {
                Some(hex) => u64::from_str_radix(hex, 16),
                None => v.parse(),
            };
            parsed.map_err(|_| bad("not a number"))
        };
        let n32 =
            |v: &str| -> Result<u32> { u32::try_from(num(v)?).map_err(|_| bad("out of range")) };
        let l = &mut self.limits;
        match key {
            "name" => {
                if value.is_empty() || value.len() > 63 || !value.is_ascii() {
                    return Err(bad("names are 1..63 ASCII characters"));
                }
                self.name = value.into();
            }
            "link" => {
                self.link_layer = match value {
                    "eth" | "ethernet" | "roce" => LinkLayer::Ethernet,
                    "ib" | "infiniband" => LinkLayer::InfiniBand,
                    _ => return Err(bad("expected eth or ib")),
                }
            }
            "mtu" => {
                self.active_mtu = Mtu::from_bytes(n32(value)?)
                    .ok_or_else(|| bad("expected 256, 512, 1024, 2048 or 4096"))?
            }
            "gid" => {
                self.gid = value
                    .parse::<std::net::Ipv6Addr>()
                    .map_err(|_| bad("not an IPv6 address"))?
                    .into()
            }
            "lid" => {
                self.lid = u16::try_from(num(value)?)
                    .ok()
                    .filter(|&l| l != 0 && l < 0xc000)
                    .ok_or_else(|| bad("unicast LIDs are 1..0xbfff"))?
            }
            "guid" => {
                self.node_guid = u64::from_str_radix(value.trim_start_matches("0x"), 16)
                    .map_err(|_| bad("expected hex"))?
            }
            "ts_bits" => self.timestamp_bits = n32(value)?,
            "ordering_check" => {
                self.ordering_check = match value {
                    "1" | "on" | "true" | "yes" => true,
                    "0" | "off" | "false" | "no" => false,
                    _ => return Err(bad("expected 0 or 1")),
                }
            }
            "netdev" => self.net.get_or_insert_default().netdev = Some(value.into()),
            "ip" => {
                self.net.get_or_insert_default().ip =
                    Some(value.parse().map_err(|_| bad("not an IP address"))?)
            }
            "drop" | "dup" | "reorder" | "corrupt" => {
                let r =
                    net::parse_rate(value).ok_or_else(|| bad("a rate in 0..=1 or 0%..=100%"))?;
                let f = &mut self.net.get_or_insert_default().faults;
                match key {
                    "drop" => f.drop = r,
                    "dup" => f.duplicate = r,
                    "reorder" => f.reorder = r,
                    _ => f.corrupt = r,
                }
            }
            "delay_us" => self.net.get_or_insert_default().faults.delay_us = num(value)?,
            "fault_seed" => self.net.get_or_insert_default().faults.seed = num(value)?,
            "max_qp" => l.max_qp = n32(value)?,
            "max_qp_wr" => l.max_qp_wr = n32(value)?,
            "max_sge" => l.max_sge = n32(value)?,
            "max_cq" => l.max_cq = n32(value)?,
            "max_cqe" => l.max_cqe = n32(value)?,
            "max_mr" => l.max_mr = n32(value)?,
            "max_mr_size" => l.max_mr_size = num(value)?,
            "max_pd" => l.max_pd = n32(value)?,
            "max_qp_rd_atom" => l.max_qp_rd_atom = n32(value)?,
            "max_srq" => l.max_srq = n32(value)?,
            "max_srq_wr" => l.max_srq_wr = n32(value)?,
            "max_srq_sge" => l.max_srq_sge = n32(value)?,
            "max_ah" => l.max_ah = n32(value)?,
            "max_inline_data" => l.max_inline_data = n32(value)?,
            _ => return Err(Error::Config(format!("unknown key `{key}`"))),
        }
        Ok(())
    }

    /// A networked device's entry in `SOFTVERBS_DEVICES` syntax: what its host engine is
    /// started with (the engine resolves the interface again).
    pub fn to_spec(&self) -> String {
        let mut s = format!(
            "name={},mtu={},ts_bits={}",
            self.name,
            self.active_mtu.bytes(),
            self.timestamp_bits
        );
        if let Some(n) = &self.net {
            if let Some(d) = &n.netdev {
                s += &format!(",netdev={d}");
            }
            if let Some(ip) = n.ip {
                s += &format!(",ip={ip}");
            }
            let f = &n.faults;
            s += &format!(
                ",drop={},dup={},reorder={},corrupt={},delay_us={},fault_seed={}",
                f.drop, f.duplicate, f.reorder, f.corrupt, f.delay_us, f.seed
            );
        }
        s
    }

    /// The GID at `index` of the table.
    pub fn gid_at(&self, index: u32) -> Option<Gid> {
        if self.gid_table.is_empty() {
            return (index == 0).then_some(self.gid);
        }
        self.gid_table.get(index as usize).copied()
    }

    /// Entries in the GID table.
    pub fn gid_count(&self) -> u32 {
        self.gid_table.len().max(1) as u32
    }

    /// A networked device takes its GIDs and MTU from its interface: done once the keys are
    /// read (an `mtu=` key may only lower what the interface carries).
    pub fn resolve_net(&mut self) -> Result<()> {
        let Some(net) = &mut self.net else {
            return Ok(());
        };
        if self.link_layer != LinkLayer::Ethernet {
            return Err(Error::Config("a networked device is RoCE: link=eth".into()));
        }
        let ifc = net::Interface::find(net.netdev.as_deref(), net.ip)?;
        let primary = net
            .ip
            .or_else(|| ifc.addrs.iter().copied().find(std::net::IpAddr::is_ipv4))
            .or_else(|| ifc.addrs.last().copied())
            .ok_or_else(|| Error::Config(format!("interface {} has no address", ifc.name)))?;
        let mtu = ifc.roce_mtu().ok_or_else(|| {
            Error::Config(format!(
                "interface {} MTU {} is too small",
                ifc.name, ifc.mtu
            ))
        })?;
        if self.active_mtu.bytes() > mtu.bytes() || self.active_mtu == Mtu::Mtu4096 {
            self.active_mtu = mtu;
        }
        self.gid = net::gid_of(primary);
        self.gid_table = ifc.addrs.iter().map(|&a| net::gid_of(a)).collect();
        net.ifindex = ifc.index;
        net.netdev = Some(ifc.name);
        net.ip = Some(primary);
        Ok(())
    }

    /// Checks that the limits are usable.
    pub fn validate(&self) -> Result<()> {
        let l = &self.limits;
        let ranges: [(&str, u64, u64, u64); 13] = [
            ("max_qp", l.max_qp.into(), 1, (1 << 18) - 2),
            ("max_qp_wr", l.max_qp_wr.into(), 1, 1 << 20),
            ("max_sge", l.max_sge.into(), 1, 256),
            ("max_cq", l.max_cq.into(), 1, 1 << 20),
            ("max_cqe", l.max_cqe.into(), 1, 1 << 24),
            ("max_mr", l.max_mr.into(), 1, (1 << 24) - 1),
            ("max_pd", l.max_pd.into(), 1, 1 << 24),
            ("max_qp_rd_atom", l.max_qp_rd_atom.into(), 1, 255),
            ("max_srq", l.max_srq.into(), 1, 1 << 20),
            ("max_srq_wr", l.max_srq_wr.into(), 1, 1 << 20),
            ("max_srq_sge", l.max_srq_sge.into(), 1, 256),
            ("max_ah", l.max_ah.into(), 1, 1 << 24),
            ("max_inline_data", l.max_inline_data.into(), 0, 1 << 16),
        ];
        for (name, v, lo, hi) in ranges {
            if !(lo..=hi).contains(&v) {
                return Err(Error::Config(format!("{name}={v} is outside {lo}..={hi}")));
            }
        }
        if l.max_mr_size == 0 {
            return Err(Error::Config("max_mr_size must be positive".into()));
        }
        if !(1..=64).contains(&self.timestamp_bits) {
            return Err(Error::Config("ts_bits must be 1..=64".into()));
        }
        if self.link_layer == LinkLayer::InfiniBand && self.lid == 0 {
            return Err(Error::Config("an InfiniBand port needs a LID".into()));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_is_one_default_device() {
        let v = DeviceConfig::parse_list("").unwrap();
        assert_eq!(v, vec![DeviceConfig::default()]);
    }

    #[test]
    fn parses_two_devices() {
        let v = DeviceConfig::parse_list("name=a,mtu=1024,max_qp=8; link=ib,lid=0x10").unwrap();
        assert_eq!(v[0].name, "a");
        assert_eq!(v[0].active_mtu, Mtu::Mtu1024);
        assert_eq!(v[0].limits.max_qp, 8);
        assert_eq!(v[1].name, "softverbs1");
        assert_eq!(v[1].link_layer, LinkLayer::InfiniBand);
        assert_eq!(v[1].lid, 16);
        assert_ne!(v[0].gid, v[1].gid);
    }

    #[test]
    fn ordering_check_is_off_unless_asked() {
        let v =
            DeviceConfig::parse_list("name=a;name=b,ordering_check=1;name=c,ordering_check=off")
                .unwrap();
        assert_eq!(
            v.iter().map(|c| c.ordering_check).collect::<Vec<_>>(),
            [false, true, false]
        );
    }

    #[test]
    fn rejects_bad_input() {
        for bad in [
            "mtu=1500",
            "nokey",
            "frob=1",
            "max_qp=0",
            "max_sge=x",
            "lid=0",
            "gid=zz",
            "ts_bits=65",
            "max_qp=99999999999",
            "ordering_check=2",
        ] {
            assert!(
                matches!(DeviceConfig::parse_list(bad), Err(Error::Config(_))),
                "{bad}"
            );
        }
    }
}
