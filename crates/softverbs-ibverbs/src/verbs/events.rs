//! Asynchronous events.

use super::*;

/// The C object registered under `id`, if it still exists.
fn lookup(map: &Mutex<HashMap<u32, usize>>, id: u32) -> Option<usize> {
    map.lock()
        .unwrap_or_else(|e| e.into_inner())
        .get(&id)
        .copied()
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn sv_ibv_get_async_event(
    ctx: *mut ibv_context,
    event: *mut ibv_async_event,
) -> c_int {
    if ctx.is_null() || event.is_null() {
        set_errno(EINVAL);
        return -1;
    }
    // SAFETY: a context of ours.
    let sv = unsafe { ctx_of(ctx) };
    let blocking = sv.async_blocking();
    loop {
        let ev = match sv.nic.events().pop(false) {
            Ok(ev) => ev,
            Err(Error::WouldBlock) if blocking => {
                if let Err(e) = wait_rung(sv.vctx.context.async_fd) {
                    set_errno(e);
                    return -1;
                }
                continue;
            }
            Err(e) => {
                set_errno(e.errno());
                return -1;
            }
        };
        let element = match ev.element {
            EventElement::Qp(n) => lookup(&sv.reg.qps, n),
            EventElement::Cq(n) => lookup(&sv.reg.cqs, n),
            EventElement::Srq(n) => lookup(&sv.reg.srqs, n),
            // The union's `int port_num`: the low bytes of the pointer-sized slot.
            EventElement::Port(p) => Some(usize::from(p)),
            EventElement::Device => Some(0),
        };
        // An event about an object the program already destroyed has no one to go to.
        let Some(element) = element else { continue };
        // SAFETY: the caller's writable event.
        unsafe {
            event.write(ibv_async_event {
                element: element as *mut c_void,
                event_type: ev.kind as c_int,
            })
        };
        return 0;
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn sv_ibv_ack_async_event(event: *mut ibv_async_event) {
    if event.is_null() {
        return;
    }
    // SAFETY: an event `ibv_get_async_event` filled; its object is live until acknowledged.
    let (el, ty) = unsafe { ((*event).element, (*event).event_type) };
    if el.is_null() {
        return;
    }
    // SAFETY: the element is the C object the event type names.
    unsafe {
        match ty {
            // IBV_EVENT_CQ_ERR
            0 => {
                let cq = el as *mut ibv_cq;
                (*cq).async_events_completed = (*cq).async_events_completed.wrapping_add(1);
            }
            // QP events: FATAL … PATH_MIG_ERR, QP_LAST_WQE_REACHED.
            1..=7 | 16 => {
                let qp = el as *mut ibv_qp;
                (*qp).events_completed = (*qp).events_completed.wrapping_add(1);
            }
            // IBV_EVENT_SRQ_ERR, IBV_EVENT_SRQ_LIMIT_REACHED
            14 | 15 => {
                let srq = el as *mut ibv_srq;
                (*srq).events_completed = (*srq).events_completed.wrapping_add(1);
            }
            _ => {}
        }
    }
}
