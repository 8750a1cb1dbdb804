//! `softverbs devinfo`: device and port attributes in the layout of rdma-core's `ibv_devinfo`.

use crate::Result;
use softverbs::{AtomicCap, Device, LinkLayer, Mtu, PortState};
use std::fmt::Write;

#[derive(clap::Args)]
pub struct Args {
    /// Only this device (default: every device).
    #[arg(short = 'd', long = "ib-dev", value_name = "DEVICE")]
    device: Option<String>,
    /// Print every attribute, not just the summary.
    #[arg(short, long)]
    verbose: bool,
}

pub fn run(args: &Args) -> Result<()> {
    let devices = match &args.device {
        Some(name) => vec![crate::find_device(Some(name))?],
        None => softverbs::devices()?,
    };
    if devices.is_empty() {
        return Err("no RDMA devices found".into());
    }
    let mut out = String::new();
    for dev in &devices {
        describe(&mut out, dev, args.verbose)?;
    }
    crate::write_stdout(&out)
}

/// A GUID the way rdma-core prints it: four groups of four hex digits.
pub fn guid_str(guid: u64) -> String {
    format!(
        "{:04x}:{:04x}:{:04x}:{:04x}",
        (guid >> 48) & 0xffff,
        (guid >> 32) & 0xffff,
        (guid >> 16) & 0xffff,
        guid & 0xffff
    )
}

fn port_state_str(s: PortState) -> &'static str {
    match s {
        PortState::Down => "PORT_DOWN",
        PortState::Init => "PORT_INIT",
        PortState::Armed => "PORT_ARMED",
        PortState::Active => "PORT_ACTIVE",
        _ => "invalid state",
    }
}

fn atomic_cap_str(c: AtomicCap) -> &'static str {
    match c {
        AtomicCap::None => "ATOMIC_NONE",
        AtomicCap::Hca => "ATOMIC_HCA",
        AtomicCap::Glob => "ATOMIC_GLOB",
    }
}

fn mtu_str(m: Mtu) -> String {
    format!("{} ({})", m.bytes(), m as u32)
}

fn link_layer_str(l: LinkLayer) -> &'static str {
    match l {
        LinkLayer::InfiniBand => "InfiniBand",
        LinkLayer::Ethernet => "Ethernet",
    }
}

fn phys_state_str(s: u8) -> &'static str {
    match s {
        1 => "SLEEP",
        2 => "POLLING",
        3 => "DISABLED",
        4 => "PORT_CONFIGURATION TRAINNING",
        5 => "LINK_UP",
        6 => "LINK_ERROR_RECOVERY",
        7 => "PHY TEST",
        _ => "invalid physical state",
    }
}

fn width_str(w: u8) -> &'static str {
    match w {
        1 => "1",
        2 => "4",
        4 => "8",
        8 => "12",
        16 => "2",
        _ => "invalid width",
    }
}

fn speed_str(s: u8) -> &'static str {
    match s {
        1 => "2.5 Gbps",
        2 => "5.0 Gbps",
        4 | 8 => "10.0 Gbps",
        16 => "14.0 Gbps",
        32 => "25.0 Gbps",
        64 => "50.0 Gbps",
        128 => "100.0 Gbps",
        _ => "invalid speed",
    }
}

fn vl_str(v: u8) -> &'static str {
    match v {
        1 => "1",
        2 => "2",
        3 => "4",
        4 => "8",
        5 => "15",
        _ => "invalid value",
    }
}

/// `IBV_DEVICE_*` capability bits and their names, in `ibv_devinfo` order.
const DEVICE_CAP_FLAGS: &[(u32, &str)] = &[
    (1, "RESIZE_MAX_WR"),
    (1 << 1, "BAD_PKEY_CNTR"),
    (1 << 2, "BAD_QKEY_CNTR"),
    (1 << 3, "RAW_MULTI"),
    (1 << 4, "AUTO_PATH_MIG"),
    (1 << 5, "CHANGE_PHY_PORT"),
    (1 << 6, "UD_AV_PORT_ENFORCE"),
    (1 << 7, "CURR_QP_STATE_MOD"),
    (1 << 8, "SHUTDOWN_PORT"),
    (1 << 9, "INIT_TYPE"),
    (1 << 10, "PORT_ACTIVE_EVENT"),
    (1 << 11, "SYS_IMAGE_GUID"),
    (1 << 12, "RC_RNR_NAK_GEN"),
    (1 << 13, "SRQ_RESIZE"),
    (1 << 14, "N_NOTIFY_CQ"),
    (1 << 17, "MEM_WINDOW"),
    (1 << 18, "UD_IP_CSUM"),
    (1 << 20, "XRC"),
    (1 << 21, "MEM_MGT_EXTENSIONS"),
    (1 << 23, "MEM_WINDOW_TYPE_2A"),
    (1 << 24, "MEM_WINDOW_TYPE_2B"),
    (1 << 25, "RC_IP_CSUM"),
    (1 << 26, "RAW_IP_CSUM"),
    (1 << 29, "MANAGED_FLOW_STEERING"),
];

/// Appends the `ibv_devinfo` description of `dev` to `o`.
fn describe(o: &mut String, dev: &Device, verbose: bool) -> Result<()> {
    let ctx = dev
        .open()
        .map_err(|e| format!("opening {}: {e}", dev.name()))?;
    let a = ctx.query_device();

    // Writing into a String cannot fail.
    macro_rules! line {
        ($($t:tt)*) => { let _ = writeln!(o, $($t)*); };
    }

    line!("hca_id:\t{}", dev.name());
    // Like rxe and siw, the software device reports the InfiniBand transport (0) for RoCE too.
    line!("\ttransport:\t\t\tInfiniBand (0)");
    if !a.fw_ver.is_empty() {
        line!("\tfw_ver:\t\t\t\t{}", a.fw_ver);
    }
    line!("\tnode_guid:\t\t\t{}", guid_str(a.node_guid));
    line!("\tsys_image_guid:\t\t\t{}", guid_str(a.sys_image_guid));
    line!("\tvendor_id:\t\t\t0x{:04x}", a.vendor_id);
    line!("\tvendor_part_id:\t\t\t{}", a.vendor_part_id);
    line!("\thw_ver:\t\t\t\t0x{:X}", a.hw_ver);
    line!("\tphys_port_cnt:\t\t\t{}", a.phys_port_cnt);

    if verbose {
        line!("\tmax_mr_size:\t\t\t0x{:x}", a.max_mr_size);
        line!("\tpage_size_cap:\t\t\t0x{:x}", a.page_size_cap);
        line!("\tmax_qp:\t\t\t\t{}", a.max_qp);
        line!("\tmax_qp_wr:\t\t\t{}", a.max_qp_wr);
        line!("\tdevice_cap_flags:\t\t0x{:08x}", a.device_cap_flags);
        let mut known = 0;
        for &(bit, name) in DEVICE_CAP_FLAGS {
            known |= bit;
            if a.device_cap_flags & bit != 0 {
                line!("\t\t\t\t\t{name}");
            }
        }
        if a.device_cap_flags & !known != 0 {
            line!(
                "\t\t\t\t\tUnknown flags: 0x{:X}",
                a.device_cap_flags & !known
            );
        }
        line!("\tmax_sge:\t\t\t{}", a.max_sge);
        line!("\tmax_sge_rd:\t\t\t{}", a.max_sge_rd);
        line!("\tmax_cq:\t\t\t\t{}", a.max_cq);
        line!("\tmax_cqe:\t\t\t{}", a.max_cqe);
        line!("\tmax_mr:\t\t\t\t{}", a.max_mr);
        line!("\tmax_pd:\t\t\t\t{}", a.max_pd);
        line!("\tmax_qp_rd_atom:\t\t\t{}", a.max_qp_rd_atom);
        line!("\tmax_ee_rd_atom:\t\t\t0");
        line!("\tmax_res_rd_atom:\t\t{}", a.max_res_rd_atom);
        line!("\tmax_qp_init_rd_atom:\t\t{}", a.max_qp_init_rd_atom);
        line!("\tmax_ee_init_rd_atom:\t\t0");
        line!(
            "\tatomic_cap:\t\t\t{} ({})",
            atomic_cap_str(a.atomic_cap),
            a.atomic_cap as u32
        );
        // softverbs has no EE contexts, RDDs, raw QPs or FMRs.
        line!("\tmax_ee:\t\t\t\t0");
        line!("\tmax_rdd:\t\t\t0");
        line!("\tmax_mw:\t\t\t\t{}", a.max_mw);
        line!("\tmax_raw_ipv6_qp:\t\t0");
        line!("\tmax_raw_ethy_qp:\t\t0");
        line!("\tmax_mcast_grp:\t\t\t{}", a.max_mcast_grp);
        line!("\tmax_mcast_qp_attach:\t\t{}", a.max_mcast_qp_attach);
        line!(
            "\tmax_total_mcast_qp_attach:\t{}",
            a.max_total_mcast_qp_attach
        );
        line!("\tmax_ah:\t\t\t\t{}", a.max_ah);
        line!("\tmax_fmr:\t\t\t0");
        line!("\tmax_srq:\t\t\t{}", a.max_srq);
        if a.max_srq != 0 {
            line!("\tmax_srq_wr:\t\t\t{}", a.max_srq_wr);
            line!("\tmax_srq_sge:\t\t\t{}", a.max_srq_sge);
        }
        line!("\tmax_pkeys:\t\t\t{}", a.max_pkeys);
        line!("\tlocal_ca_ack_delay:\t\t{}", a.local_ca_ack_delay);
        // Not an ibv_devinfo line: the largest inline payload a QP may request.
        line!("\tmax_inline_data:\t\t{}", a.max_inline_data);
        // On-demand paging, in ibv_devinfo's words.
        let o = a.odp_caps;
        line!("\tgeneral_odp_caps:");
        for (bit, name) in [(1, "ODP_SUPPORT"), (2, "ODP_SUPPORT_IMPLICIT")] {
            if o.general_caps & bit != 0 {
                line!("\t\t\t\t\t{name}");
            }
        }
        let ops = [
            (1, "SEND"),
            (2, "RECV"),
            (4, "WRITE"),
            (8, "READ"),
            (16, "ATOMIC"),
            (32, "SRQ"),
        ];
        for (t, caps) in [
            ("rc", o.rc_odp_caps),
            ("uc", o.uc_odp_caps),
            ("ud", o.ud_odp_caps),
            ("xrc", 0),
        ] {
            line!("\t{t}_odp_caps:");
            if caps == 0 {
                line!("\t\t\t\t\tNO SUPPORT");
            }
            for (bit, name) in ops {
                if caps & bit != 0 {
                    line!("\t\t\t\t\tSUPPORT_{name}");
                }
            }
        }
        if a.completion_timestamp_mask != 0 {
            line!(
                "\tcompletion timestamp_mask:\t\t\t0x{:016x}",
                a.completion_timestamp_mask
            );
        } else {
            line!("\tcompletion_timestamp_mask not supported");
        }
        if a.hca_core_clock != 0 {
            line!("\thca_core_clock:\t\t\t{}kHZ", a.hca_core_clock);
        } else {
            line!("\tcore clock not supported");
        }
    }

    for port in 1..=a.phys_port_cnt {
        let p = ctx
            .query_port(port)
            .map_err(|e| format!("querying port {port} of {}: {e}", dev.name()))?;
        line!("\t\tport:\t{port}");
        line!(
            "\t\t\tstate:\t\t\t{} ({})",
            port_state_str(p.state),
            p.state as u32
        );
        line!("\t\t\tmax_mtu:\t\t{}", mtu_str(p.max_mtu));
        line!("\t\t\tactive_mtu:\t\t{}", mtu_str(p.active_mtu));
        line!("\t\t\tsm_lid:\t\t\t{}", p.sm_lid);
        line!("\t\t\tport_lid:\t\t{}", p.lid);
        line!("\t\t\tport_lmc:\t\t0x{:02x}", p.lmc);
        line!("\t\t\tlink_layer:\t\t{}", link_layer_str(p.link_layer));
        if verbose {
            line!("\t\t\tmax_msg_sz:\t\t0x{:x}", p.max_msg_sz);
            line!("\t\t\tport_cap_flags:\t\t0x{:08x}", p.port_cap_flags);
            line!("\t\t\tport_cap_flags2:\t0x0000");
            line!(
                "\t\t\tmax_vl_num:\t\t{} ({})",
                vl_str(p.max_vl_num),
                p.max_vl_num
            );
            line!("\t\t\tbad_pkey_cntr:\t\t0x{:x}", p.bad_pkey_cntr);
            line!("\t\t\tqkey_viol_cntr:\t\t0x{:x}", p.qkey_viol_cntr);
            line!("\t\t\tsm_sl:\t\t\t{}", p.sm_sl);
            line!("\t\t\tpkey_tbl_len:\t\t{}", p.pkey_tbl_len);
            line!("\t\t\tgid_tbl_len:\t\t{}", p.gid_tbl_len);
            line!("\t\t\tsubnet_timeout:\t\t{}", p.subnet_timeout);
            line!("\t\t\tinit_type_reply:\t{}", p.init_type_reply);
            line!(
                "\t\t\tactive_width:\t\t{}X ({})",
                width_str(p.active_width),
                p.active_width
            );
            line!(
                "\t\t\tactive_speed:\t\t{} ({})",
                speed_str(p.active_speed),
                p.active_speed
            );
            line!(
                "\t\t\tphys_state:\t\t{} ({})",
                phys_state_str(p.phys_state),
                p.phys_state
            );
            for index in 0..u32::try_from(p.gid_tbl_len).unwrap_or(0) {
                let gid = ctx
                    .query_gid(port, index)
                    .map_err(|e| format!("querying GID {index} of {}: {e}", dev.name()))?;
                if !gid.is_zero() {
                    // rdma-core's ibv_devinfo names the type of RoCE GIDs.
                    let kind = match p.link_layer {
                        softverbs::LinkLayer::Ethernet => ", RoCE v2",
                        softverbs::LinkLayer::InfiniBand => "",
                    };
                    line!("\t\t\tGID[{index:3}]:\t\t{gid}{kind}");
                }
            }
        }
        if verbose && dev.is_networked() {
            // The host engine's counters, as soft-RoCE shows its hardware counters.
            match dev.engine_report() {
                Ok(report) => {
                    line!("\tengine (RoCEv2 over UDP 4791):");
                    for l in report.lines() {
                        line!("\t\t{l}");
                    }
                }
                Err(_) => {
                    line!("\tengine: not running (no program has the device open)");
                }
            }
        }
        line!();
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn guids_print_like_rdma_core() {
        assert_eq!(guid_str(0x0250_56ff_fe00_0001), "0250:56ff:fe00:0001");
        assert_eq!(guid_str(0), "0000:0000:0000:0000");
    }

    #[test]
    fn verbose_output_has_every_section() {
        let dev = crate::find_device(None).unwrap();
        let mut o = String::new();
        describe(&mut o, &dev, true).unwrap();
        for key in [
            "hca_id:",
            "node_guid:",
            "max_qp_wr:",
            "max_srq_sge:",
            "atomic_cap:",
            "CURR_QP_STATE_MOD",
            "completion timestamp_mask:",
            "hca_core_clock:",
            "state:\t\t\tPORT_ACTIVE (4)",
            "max_msg_sz:",
            "GID[  0]:",
        ] {
            assert!(o.contains(key), "{key} missing in\n{o}");
        }
        let mut short = String::new();
        describe(&mut short, &dev, false).unwrap();
        assert!(!short.contains("max_qp:"));
        assert!(short.contains("link_layer:"));
    }
}
