//! The verbs QP state machine, as pure functions: which transitions exist, which attributes
//! each requires and allows (IBA 11.2.4.2), and how the given ones apply.

use super::attr::QpAttr;
use crate::types::{QpAttrMask as M, QpState, QpType};

/// Required and optional attributes of a transition (IBA 11.2.4.2 / the kernel's
/// `qp_state_table`); `None` for a transition verbs does not allow.
pub(super) fn transition(cur: QpState, next: QpState, t: QpType) -> Option<(M, M)> {
    let (req, opt) = rc_like(cur, next, t)?;
    Some(match (t, cur, next) {
        // An initiator receives nothing: no responder resources, no RNR timer.
        (QpType::XrcSend, QpState::Init, QpState::Rtr) => {
            (req - (M::MAX_DEST_RD_ATOMIC | M::MIN_RNR_TIMER), opt)
        }
        (QpType::XrcSend, _, _) => (req, opt - M::MIN_RNR_TIMER),
        // A target sends nothing but its responses: no retries, no initiator depth.
        (QpType::XrcRecv, QpState::Rtr, QpState::Rts) => (
            req - (M::RETRY_CNT | M::RNR_RETRY | M::MAX_QP_RD_ATOMIC),
            opt,
        ),
        _ => (req, opt),
    })
}

fn rc_like(cur: QpState, next: QpState, t: QpType) -> Option<(M, M)> {
    use QpState::*;
    // XRC follows RC (the kernel's table), less what the half without a receive side
    // (the initiator) or without a send side (the target) has no use for: see below.
    let by_type = |rc: M, uc: M, ud: M| match t {
        QpType::Rc | QpType::XrcSend | QpType::XrcRecv => rc,
        QpType::Uc => uc,
        QpType::Ud => ud,
    };
    let e = M::empty();
    Some(match (cur, next) {
        (_, Reset) | (_, Err) => (e, e),
        (Reset, Init) => (
            M::PKEY_INDEX | M::PORT | by_type(M::ACCESS_FLAGS, M::ACCESS_FLAGS, M::QKEY),
            e,
        ),
        (Init, Init) => (
            e,
            M::PKEY_INDEX | M::PORT | by_type(M::ACCESS_FLAGS, M::ACCESS_FLAGS, M::QKEY),
        ),
        (Init, Rtr) => (
            by_type(
                M::AV
                    | M::PATH_MTU
                    | M::DEST_QPN
                    | M::RQ_PSN
                    | M::MAX_DEST_RD_ATOMIC
                    | M::MIN_RNR_TIMER,
                M::AV | M::PATH_MTU | M::DEST_QPN | M::RQ_PSN,
                e,
            ),
            by_type(
                M::ALT_PATH | M::ACCESS_FLAGS | M::PKEY_INDEX,
                M::ALT_PATH | M::ACCESS_FLAGS | M::PKEY_INDEX,
                M::PKEY_INDEX | M::QKEY,
            ),
        ),
        (Rtr, Rts) => (
            by_type(
                M::SQ_PSN | M::TIMEOUT | M::RETRY_CNT | M::RNR_RETRY | M::MAX_QP_RD_ATOMIC,
                M::SQ_PSN,
                M::SQ_PSN,
            ),
            by_type(
                M::CUR_STATE | M::ALT_PATH | M::ACCESS_FLAGS | M::MIN_RNR_TIMER | M::PATH_MIG_STATE,
                M::CUR_STATE | M::ALT_PATH | M::ACCESS_FLAGS | M::PATH_MIG_STATE,
                M::CUR_STATE | M::QKEY,
            ),
        ),
        (Rts, Rts) | (Sqd, Rts) => (
            e,
            by_type(
                M::CUR_STATE | M::ACCESS_FLAGS | M::ALT_PATH | M::PATH_MIG_STATE | M::MIN_RNR_TIMER,
                M::CUR_STATE | M::ACCESS_FLAGS | M::ALT_PATH | M::PATH_MIG_STATE,
                M::CUR_STATE | M::QKEY,
            ),
        ),
        (Rts, Sqd) => (e, M::EN_SQD_ASYNC_NOTIFY),
        (Sqd, Sqd) => (
            e,
            by_type(
                M::PORT
                    | M::AV
                    | M::TIMEOUT
                    | M::RETRY_CNT
                    | M::RNR_RETRY
                    | M::MAX_QP_RD_ATOMIC
                    | M::MAX_DEST_RD_ATOMIC
                    | M::ALT_PATH
                    | M::ACCESS_FLAGS
                    | M::PKEY_INDEX
                    | M::MIN_RNR_TIMER
                    | M::PATH_MIG_STATE,
                M::AV | M::ALT_PATH | M::ACCESS_FLAGS | M::PKEY_INDEX | M::PATH_MIG_STATE,
                M::PKEY_INDEX | M::QKEY,
            ),
        ),
        (Sqe, Rts) if !t.is_reliable() => (
            e,
            by_type(e, M::CUR_STATE | M::ACCESS_FLAGS, M::CUR_STATE | M::QKEY),
        ),
        _ => return None,
    })
}

pub(super) fn apply(a: &mut QpAttr, n: &QpAttr, m: M) {
    if m.contains(M::ACCESS_FLAGS) {
        a.qp_access_flags = n.qp_access_flags;
    }
    if m.contains(M::PKEY_INDEX) {
        a.pkey_index = n.pkey_index;
    }
    if m.contains(M::PORT) {
        a.port_num = n.port_num;
    }
    if m.contains(M::QKEY) {
        a.qkey = n.qkey;
    }
    if m.contains(M::AV) {
        a.ah_attr = n.ah_attr;
    }
    if m.contains(M::PATH_MTU) {
        a.path_mtu = n.path_mtu;
    }
    if m.contains(M::TIMEOUT) {
        a.timeout = n.timeout;
    }
    if m.contains(M::RETRY_CNT) {
        a.retry_cnt = n.retry_cnt;
    }
    if m.contains(M::RNR_RETRY) {
        a.rnr_retry = n.rnr_retry;
    }
    if m.contains(M::RQ_PSN) {
        a.rq_psn = n.rq_psn;
    }
    if m.contains(M::MAX_QP_RD_ATOMIC) {
        a.max_rd_atomic = n.max_rd_atomic;
    }
    if m.contains(M::MIN_RNR_TIMER) {
        a.min_rnr_timer = n.min_rnr_timer;
    }
    if m.contains(M::SQ_PSN) {
        a.sq_psn = n.sq_psn;
    }
    if m.contains(M::MAX_DEST_RD_ATOMIC) {
        a.max_dest_rd_atomic = n.max_dest_rd_atomic;
    }
    if m.contains(M::PATH_MIG_STATE) {
        a.path_mig_state = n.path_mig_state;
    }
    if m.contains(M::DEST_QPN) {
        a.dest_qp_num = n.dest_qp_num;
    }
    if m.contains(M::EN_SQD_ASYNC_NOTIFY) {
        a.en_sqd_async_notify = n.en_sqd_async_notify;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transition_table_spot_checks() {
        use QpState::*;
        assert!(transition(Reset, Rtr, QpType::Rc).is_none());
        assert!(transition(Init, Rts, QpType::Ud).is_none());
        assert!(transition(Sqe, Rts, QpType::Rc).is_none());
        assert!(transition(Sqe, Rts, QpType::Ud).is_some());
        let (req, _) = transition(Init, Rtr, QpType::Rc).unwrap();
        assert!(req.contains(M::DEST_QPN | M::AV | M::MIN_RNR_TIMER));
        let (req, _) = transition(Init, Rtr, QpType::Ud).unwrap();
        assert!(req.is_empty());
        let (req, _) = transition(Init, Rtr, QpType::XrcSend).unwrap();
        assert!(req.contains(M::DEST_QPN) && !req.contains(M::MIN_RNR_TIMER));
        let (req, _) = transition(Init, Rtr, QpType::XrcRecv).unwrap();
        assert!(req.contains(M::MIN_RNR_TIMER | M::MAX_DEST_RD_ATOMIC));
        let (req, _) = transition(Rtr, Rts, QpType::XrcRecv).unwrap();
        assert_eq!(req, M::SQ_PSN | M::TIMEOUT);
        for s in [Reset, Init, Rtr, Rts, Sqd, Sqe, Err] {
            assert!(transition(s, Err, QpType::Uc).is_some());
            assert!(transition(s, Reset, QpType::Uc).is_some());
        }
    }
}
