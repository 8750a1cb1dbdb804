//! Every `#[repr(C)]` mirror in `src/abi.rs` against `<infiniband/verbs.h>`: a C program
//! compiled against the installed header prints `sizeof`/`offsetof` for each mirrored struct
//! and field, and each must equal Rust's `size_of`/`offset_of!`.
//!
//! Needs `cc` and Debian's `libibverbs-dev`; without them the test is skipped with a message,
//! except under `CI=true`, where it fails.

#[allow(unused_imports)]
#[path = "../src/abi.rs"]
mod abi;

use abi::*;
use std::mem::{offset_of, size_of};
use std::path::Path;
use std::process::Command;

/// `(C struct name, C member expression, Rust offset)` and `(C expression, Rust value)`.
struct Checks {
    sizes: Vec<(String, usize)>,
    fields: Vec<(&'static str, String, usize)>,
}

macro_rules! mirror {
    ($c:ident, $($s:ident { $($f:ident $(= $cf:literal)?),* $(,)? })*) => {
        $(
            $c.sizes.push((format!("sizeof(struct {})", stringify!($s)), size_of::<$s>()));
            $c.sizes.push((
                format!("_Alignof(struct {})", stringify!($s)),
                std::mem::align_of::<$s>(),
            ));
            $(
                #[allow(unused_mut, unused_assignments)]
                let mut name = stringify!($f).to_string();
                $( name = $cf.to_string(); )?
                $c.fields.push((stringify!($s), name, offset_of!($s, $f)));
            )*
        )*
    };
}

fn checks() -> Checks {
    let mut c = Checks {
        sizes: Vec::new(),
        fields: Vec::new(),
    };
    mirror!(c,
        ibv_device { _ops, node_type, transport_type, name, dev_name, dev_path, ibdev_path }
        ibv_context_ops {
            alloc_mw, bind_mw, dealloc_mw, poll_cq, req_notify_cq, post_srq_recv, post_send,
            post_recv
        }
        ibv_context { device, ops, cmd_fd, async_fd, num_comp_vectors, mutex, abi_compat }
        verbs_context {
            query_port, advise_mr, reg_dm_mr, alloc_dm, free_dm, alloc_parent_domain,
            dealloc_td, alloc_td, query_rt_values,
            create_cq_ex, priv_ = "priv", query_device_ex, create_qp_ex, _ABI_placeholder3, sz,
            context
        }
        ibv_device_attr {
            fw_ver, node_guid, sys_image_guid, max_mr_size, page_size_cap, vendor_id,
            vendor_part_id, hw_ver, max_qp, max_qp_wr, device_cap_flags, max_sge, max_sge_rd,
            max_cq, max_cqe, max_mr, max_pd, max_qp_rd_atom, max_ee_rd_atom, max_res_rd_atom,
            max_qp_init_rd_atom, max_ee_init_rd_atom, atomic_cap, max_ee, max_rdd, max_mw,
            max_raw_ipv6_qp, max_raw_ethy_qp, max_mcast_grp, max_mcast_qp_attach,
            max_total_mcast_qp_attach, max_ah, max_fmr, max_map_per_fmr, max_srq, max_srq_wr,
            max_srq_sge, max_pkeys, local_ca_ack_delay, phys_port_cnt
        }
        ibv_port_attr {
            state, max_mtu, active_mtu, gid_tbl_len, port_cap_flags, max_msg_sz,
            bad_pkey_cntr, qkey_viol_cntr, pkey_tbl_len, lid, sm_lid, lmc, max_vl_num, sm_sl,
            subnet_timeout, init_type_reply, active_width, active_speed, phys_state,
            link_layer, flags, port_cap_flags2
        }
        ibv_pd { context, handle }
        ibv_mr { context, pd, addr, length, handle, lkey, rkey }
        ibv_mw { context, pd, rkey, handle, type_ = "type" }
        ibv_mw_bind_info { mr, addr, length, mw_access_flags }
        ibv_mw_bind { wr_id, send_flags, bind_info }
        ibv_comp_channel { context, fd, refcnt }
        ibv_cq {
            context, channel, cq_context, handle, cqe, mutex, cond, comp_events_completed,
            async_events_completed
        }
        ibv_srq { context, srq_context, pd, handle, mutex, cond, events_completed }
        ibv_qp {
            context, qp_context, pd, send_cq, recv_cq, srq, handle, qp_num, state, qp_type,
            mutex, cond, events_completed
        }
        ibv_qp_cap { max_send_wr, max_recv_wr, max_send_sge, max_recv_sge, max_inline_data }
        ibv_qp_init_attr { qp_context, send_cq, recv_cq, srq, cap, qp_type, sq_sig_all }
        ibv_global_route { dgid, flow_label, sgid_index, hop_limit, traffic_class }
        ibv_ah_attr { grh, dlid, sl, src_path_bits, static_rate, is_global, port_num }
        ibv_qp_attr {
            qp_state, cur_qp_state, path_mtu, path_mig_state, qkey, rq_psn, sq_psn,
            dest_qp_num, qp_access_flags, cap, ah_attr, alt_ah_attr, pkey_index,
            alt_pkey_index, en_sqd_async_notify, sq_draining, max_rd_atomic,
            max_dest_rd_atomic, min_rnr_timer, port_num, timeout, retry_cnt, rnr_retry,
            alt_port_num, alt_timeout, rate_limit
        }
        ibv_wc {
            wr_id, status, opcode, vendor_err, byte_len, imm_data, qp_num, src_qp, wc_flags,
            pkey_index, slid, sl, dlid_path_bits
        }
        ibv_sge { addr, length, lkey }
        ibv_send_wr {
            wr_id, next, sg_list, num_sge, opcode, send_flags, imm_data, wr, qp_type,
            _tail = "bind_mw"
        }
        ibv_recv_wr { wr_id, next, sg_list, num_sge }
        ibv_ah { context, pd, handle }
        ibv_qp_init_attr_ex {
            qp_context, send_cq, recv_cq, srq, cap, qp_type, sq_sig_all, comp_mask, pd, xrcd,
            create_flags, max_tso_header, rwq_ind_tbl, rx_hash_conf, source_qpn, send_ops_flags
        }
        ibv_data_buf { addr, length }
        ibv_qp_ex {
            qp_base, comp_mask, wr_id, wr_flags, wr_atomic_cmp_swp, wr_atomic_fetch_add,
            wr_bind_mw, wr_local_inv, wr_rdma_read, wr_rdma_write, wr_rdma_write_imm, wr_send,
            wr_send_imm, wr_send_inv, wr_send_tso, wr_set_ud_addr, wr_set_xrc_srqn,
            wr_set_inline_data, wr_set_inline_data_list, wr_set_sge, wr_set_sge_list, wr_start,
            wr_complete, wr_abort, wr_atomic_write
        }
        ibv_srq_attr { max_wr, max_sge, srq_limit }
        ibv_srq_init_attr { srq_context, attr }
        ibv_poll_cq_attr { comp_mask }
        ibv_cq_ex {
            context, channel, cq_context, handle, cqe, mutex, cond, comp_events_completed,
            async_events_completed, comp_mask, status, wr_id, start_poll, next_poll, end_poll,
            read_opcode, read_vendor_err, read_byte_len, read_imm_data, read_qp_num,
            read_src_qp, read_wc_flags, read_slid, read_sl, read_dlid_path_bits,
            read_completion_ts, read_cvlan, read_flow_tag, read_tm_info,
            read_completion_wallclock_ns
        }
        ibv_cq_init_attr_ex {
            cqe, cq_context, channel, comp_vector, wc_flags, comp_mask, flags, parent_domain
        }
        ibv_odp_caps {
            general_caps, rc_odp_caps = "per_transport_caps.rc_odp_caps",
            uc_odp_caps = "per_transport_caps.uc_odp_caps",
            ud_odp_caps = "per_transport_caps.ud_odp_caps"
        }
        ibv_device_attr_ex {
            orig_attr, comp_mask, odp_caps, completion_timestamp_mask, hca_core_clock,
            device_cap_flags_ex, _rest = "tso_caps", max_dm_size, _tail = "pci_atomic_caps"
        }
        ibv_alloc_dm_attr { length, log_align_req, comp_mask }
        ibv_td_init_attr { comp_mask }
        ibv_td { context }
        ibv_parent_domain_init_attr { pd, td, comp_mask, alloc, free, pd_context }
        ibv_dm { context, memcpy_to_dm, memcpy_from_dm, comp_mask, handle }
        ibv_query_device_ex_input { comp_mask }
        ibv_values_ex { comp_mask, raw_clock }
        ibv_async_event { element, event_type }
        ibv_gid_entry { gid, gid_index, port_num, gid_type, ndev_ifindex }
    );
    c.sizes
        .push(("sizeof(union ibv_gid)".into(), size_of::<ibv_gid>()));
    c.sizes.push((
        "_Alignof(union ibv_gid)".into(),
        std::mem::align_of::<ibv_gid>(),
    ));
    // Members of the `wr` union of `struct ibv_send_wr`.
    let wr = offset_of!(ibv_send_wr, wr);
    for (name, off) in [
        ("wr.rdma.remote_addr", offset_of!(wr_rdma, remote_addr)),
        ("wr.rdma.rkey", offset_of!(wr_rdma, rkey)),
        ("wr.atomic.remote_addr", offset_of!(wr_atomic, remote_addr)),
        ("wr.atomic.compare_add", offset_of!(wr_atomic, compare_add)),
        ("wr.atomic.swap", offset_of!(wr_atomic, swap)),
        ("wr.atomic.rkey", offset_of!(wr_atomic, rkey)),
        ("wr.ud.ah", offset_of!(wr_ud, ah)),
        ("wr.ud.remote_qpn", offset_of!(wr_ud, remote_qpn)),
        ("wr.ud.remote_qkey", offset_of!(wr_ud, remote_qkey)),
    ] {
        c.fields.push(("ibv_send_wr", name.to_string(), wr + off));
    }
    c
}

/// Skips (or, with `CI=true`, fails) when something the test needs is missing.
fn missing(what: &str) {
    let msg = format!("layout test needs {what}");
    if std::env::var("CI").as_deref() == Ok("true") {
        panic!("{msg} (CI=true: not skipping)");
    }
    eprintln!("SKIPPED: {msg}");
}

#[test]
fn mirrors_match_verbs_h() {
    if !Path::new("/usr/include/infiniband/verbs.h").exists() {
        return missing("/usr/include/infiniband/verbs.h (apt-get install libibverbs-dev)");
    }
    let c = checks();
    let mut prog = String::from(
        "#include <stdio.h>\n#include <stddef.h>\n#include <infiniband/verbs.h>\nint main(void) {\n",
    );
    let mut want = Vec::new();
    for (expr, v) in &c.sizes {
        prog += &format!("  printf(\"%zu\\n\", (size_t){expr});\n");
        want.push((expr.clone(), *v));
    }
    for (s, f, off) in &c.fields {
        prog += &format!("  printf(\"%zu\\n\", offsetof(struct {s}, {f}));\n");
        want.push((format!("offsetof(struct {s}, {f})"), *off));
    }
    prog += "  return 0;\n}\n";
    let dir = std::env::temp_dir().join(format!("softverbs-layout-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let src = dir.join("layout.c");
    let exe = dir.join("layout");
    std::fs::write(&src, &prog).unwrap();
    let cc = match Command::new("cc").arg(&src).arg("-o").arg(&exe).output() {
        Ok(o) => o,
        Err(e) => return missing(&format!("a C compiler `cc` ({e})")),
    };
    assert!(
        cc.status.success(),
        "cc failed:\n{}\n{prog}",
        String::from_utf8_lossy(&cc.stderr)
    );
    let out = Command::new(&exe).output().unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    let text = String::from_utf8(out.stdout).unwrap();
    let got: Vec<usize> = text.lines().map(|l| l.parse().unwrap()).collect();
    assert_eq!(got.len(), want.len());
    let bad: Vec<String> = want
        .iter()
        .zip(&got)
        .filter(|((_, r), c)| r != *c)
        .map(|((what, r), c)| format!("{what}: C {c}, Rust {r}"))
        .collect();
    assert!(bad.is_empty(), "layout mismatches:\n{}", bad.join("\n"));
    println!("{} sizes and offsets match verbs.h", want.len());
}
