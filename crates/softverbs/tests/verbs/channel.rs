//! Completion channels and async events.

use crate::common::*;
use rustix::event::epoll;
use softverbs::*;
use std::os::fd::AsFd;

#[test]
fn a_completion_channel_wakes_an_epoll_waiter() {
    let ctx = ctx();
    let pd = ctx.alloc_pd().unwrap();
    let ch = ctx.create_comp_channel().unwrap();
    let cq_r = ctx.create_cq(16, Some(&ch)).unwrap();
    let cq_s = ctx.create_cq(16, None).unwrap();
    let s = pd
        .create_qp(&QpInitAttr::new(QpType::Rc, &cq_s, &cq_s))
        .unwrap();
    let r = pd
        .create_qp(&QpInitAttr::new(QpType::Rc, &cq_r, &cq_r))
        .unwrap();
    s.connect(&r.endpoint(0).unwrap(), 0, ALL_REMOTE).unwrap();
    r.connect(&s.endpoint(0).unwrap(), 0, ALL_REMOTE).unwrap();
    let buf = pd.alloc_mr(64, ALL_REMOTE).unwrap();
    r.post_recv([RecvWr::new(1, &[buf.sge(0..64)])]).unwrap();
    cq_r.req_notify(false).unwrap();

    let ep = epoll::create(epoll::CreateFlags::CLOEXEC).unwrap();
    epoll::add(
        &ep,
        ch.as_fd(),
        epoll::EventData::new_u64(42),
        epoll::EventFlags::IN,
    )
    .unwrap();
    let waiter = std::thread::spawn(move || {
        let mut events = Vec::with_capacity(4);
        let ts = rustix::time::Timespec {
            tv_sec: 10,
            tv_nsec: 0,
        };
        epoll::wait(&ep, rustix::buffer::spare_capacity(&mut events), Some(&ts)).unwrap();
        events.iter().map(|e| e.data.u64()).collect::<Vec<_>>()
    });
    std::thread::sleep(std::time::Duration::from_millis(50));
    s.post_send([SendWr::inline(1, SendOp::Send, b"wake")])
        .unwrap();
    assert_eq!(
        waiter.join().unwrap(),
        vec![42],
        "the epoll waiter woke for the channel"
    );
    let got = ch.try_get_cq_event().unwrap();
    assert!(got.same_as(&cq_r));
    got.ack_events(1);
    assert_eq!(poll_n(&cq_r, 1)[0].byte_len(), 4);
    // Not re-armed: no further event.
    r.post_recv([RecvWr::new(2, &[buf.sge(0..64)])]).unwrap();
    s.post_send([SendWr::inline(2, SendOp::Send, b"again")])
        .unwrap();
    poll_n(&cq_r, 1);
    assert!(matches!(ch.try_get_cq_event(), Err(Error::WouldBlock)));
}

#[test]
fn blocking_get_cq_event_and_solicited_only_arming() {
    let ctx = ctx();
    let pd = ctx.alloc_pd().unwrap();
    let ch = ctx.create_comp_channel().unwrap();
    let cq_r = ctx.create_cq(16, Some(&ch)).unwrap();
    let cq_s = ctx.create_cq(16, None).unwrap();
    let s = pd
        .create_qp(&QpInitAttr::new(QpType::Rc, &cq_s, &cq_s))
        .unwrap();
    let r = pd
        .create_qp(&QpInitAttr::new(QpType::Rc, &cq_r, &cq_r))
        .unwrap();
    s.connect(&r.endpoint(0).unwrap(), 0, ALL_REMOTE).unwrap();
    r.connect(&s.endpoint(0).unwrap(), 0, ALL_REMOTE).unwrap();
    let buf = pd.alloc_mr(64, ALL_REMOTE).unwrap();
    r.post_recv((0..2).map(|i| RecvWr::new(i, &[])).collect::<Vec<_>>())
        .unwrap();
    cq_r.req_notify(true).unwrap();
    s.post_send([SendWr::inline(1, SendOp::Send, b"")]).unwrap();
    poll_n(&cq_r, 1);
    assert!(
        ch.try_get_cq_event().is_err(),
        "unsolicited message does not fire a solicited arm"
    );
    let ch2 = ch.clone();
    let t = std::thread::spawn(move || ch2.get_cq_event().map(|_| ()));
    std::thread::sleep(std::time::Duration::from_millis(30));
    s.post_send([SendWr::inline(2, SendOp::Send, b"").flags(SendFlags::SOLICITED)])
        .unwrap();
    t.join().unwrap().unwrap();
    let _ = buf;
}

#[test]
fn req_notify_needs_a_channel_and_cq_overrun_is_an_async_event() {
    let ctx = ctx();
    let cq = ctx.create_cq(1, None).unwrap();
    assert!(cq.req_notify(false).is_err());
    let pd = ctx.alloc_pd().unwrap();
    let cq_s = ctx.create_cq(16, None).unwrap();
    let s = pd
        .create_qp(&QpInitAttr::new(QpType::Rc, &cq_s, &cq_s))
        .unwrap();
    let r = pd
        .create_qp(&QpInitAttr::new(QpType::Rc, &cq, &cq))
        .unwrap();
    s.connect(&r.endpoint(0).unwrap(), 0, ALL_REMOTE).unwrap();
    r.connect(&s.endpoint(0).unwrap(), 0, ALL_REMOTE).unwrap();
    let n = cq.capacity() as u64 + 1;
    r.post_recv((0..n).map(|i| RecvWr::new(i, &[])).collect::<Vec<_>>())
        .unwrap();
    for i in 0..n {
        s.post_send([SendWr::inline(i, SendOp::Send, b"")]).unwrap();
    }
    let ev = ctx.try_get_async_event().unwrap();
    assert_eq!(ev.kind, AsyncEventType::CqErr);
    // The QP whose completion was lost is failed with a fatal event.
    let ev = ctx.get_async_event().unwrap();
    assert_eq!(
        (ev.kind, ev.element),
        (AsyncEventType::QpFatal, EventElement::Qp(r.qp_num()))
    );
    assert_eq!(r.state(), QpState::Err);
}

#[test]
fn cq_resize_keeps_pending_completions() {
    let p = pair(QpType::Rc);
    for i in 0..3 {
        p.b.post_recv([RecvWr::new(i, &[])]).unwrap();
        p.a.post_send([SendWr::inline(i, SendOp::Send, b"")])
            .unwrap();
    }
    assert!(
        p.cq_b.resize(2).is_err(),
        "cannot shrink below the queued completions"
    );
    let max = p.ctx.query_device().max_cqe;
    for bad in [0, max + 1, u32::MAX] {
        assert!(
            matches!(p.cq_b.resize(bad), Err(Error::InvalidArgument(_))),
            "resize to {bad} (max_cqe {max})"
        );
    }
    assert!(p.cq_b.resize(1000).unwrap() >= 1000);
    let wc = poll_n(&p.cq_b, 3);
    assert_eq!(
        wc.iter().map(|w| w.wr_id()).collect::<Vec<_>>(),
        vec![0, 1, 2]
    );
}
