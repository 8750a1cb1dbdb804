//! Resolution: the SGEs and remote ranges of a work request, checked against a key table and
//! turned into the spans the memory accessor moves bytes between.
//!
//! Every range is pinned with the PD and rights its side needs before any byte moves, and the
//! pins live as long as the spans: a bad key is a status for the caller to report, and a
//! region cannot be deregistered under a transfer. A layout key resolves into the pieces of
//! the regions it is made of, each pinned in turn (see [`crate::mr::store`] for where layouts
//! are read from).

use crate::mr::access::Span;
use crate::mr::keys::{KeyError, KeyTable, Pin, PinBy};
use crate::mr::layout::{LayoutCaps, PLAIN_KEY};
use crate::mr::ordering::Placement;
use crate::mr::store;
use crate::types::{AccessFlags, Sge};

/// A pinned range of one key: one span (an ordinary key, no allocation), or the pieces of a
/// layout.
pub(crate) enum Pinned<'t> {
    One(Pin<'t>, Span),
    Many(Spans<'t>),
}

impl Pinned<'_> {
    pub(crate) fn spans(&self) -> &[Span] {
        match self {
            Pinned::One(_, s) => std::slice::from_ref(s),
            Pinned::Many(m) => &m.spans,
        }
    }
    #[inline(always)]
    pub(crate) fn placement(&self) -> Placement {
        match self {
            Pinned::One(p, _) => p.placement(),
            Pinned::Many(m) => m.placement(),
        }
    }
}

/// A list that holds one item without allocating: nearly every work request has one SGE, and
/// two allocations per request (its spans and its pins) cost more than resolving it.
#[derive(Debug, Clone)]
pub(crate) enum Few<T> {
    Inline(Option<T>),
    Heap(Vec<T>),
}

impl<T> Few<T> {
    pub(crate) const fn new() -> Few<T> {
        Few::Inline(None)
    }

    pub(crate) fn push(&mut self, item: T) {
        match self {
            Few::Inline(slot @ None) => *slot = Some(item),
            Few::Inline(Some(_)) => {
                let Few::Inline(Some(first)) = std::mem::replace(self, Few::Heap(Vec::new()))
                else {
                    unreachable!("matched above")
                };
                *self = Few::Heap(vec![first, item]);
            }
            Few::Heap(v) => v.push(item),
        }
    }

    /// The list as a `Vec`, moving an inline item there (for layouts, which resolve to many).
    pub(crate) fn as_vec(&mut self) -> &mut Vec<T> {
        if let Few::Inline(one) = self {
            let v: Vec<T> = one.take().into_iter().collect();
            *self = Few::Heap(v);
        }
        match self {
            Few::Heap(v) => v,
            Few::Inline(_) => unreachable!("made a Vec above"),
        }
    }
}

impl<T> Default for Few<T> {
    fn default() -> Few<T> {
        Few::new()
    }
}

impl<T> Extend<T> for Few<T> {
    #[inline]
    fn extend<I: IntoIterator<Item = T>>(&mut self, items: I) {
        let mut items = items.into_iter();
        // The usual receive: one SGE into an empty list, stored without the general push.
        if let Few::Inline(slot @ None) = self {
            match items.next() {
                Some(first) => *slot = Some(first),
                None => return,
            }
        }
        for item in items {
            self.push(item);
        }
    }
}

impl<T> std::ops::Deref for Few<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        match self {
            Few::Inline(None) => &[],
            Few::Inline(Some(t)) => std::slice::from_ref(t),
            Few::Heap(v) => v,
        }
    }
}

/// Pinned spans of one side of a transfer.
pub(crate) struct Spans<'k> {
    pub(crate) spans: Few<Span>,
    /// What keeps the spans registered until the transfer is over.
    pub(crate) pins: Few<Pin<'k>>,
    pub(crate) len: u64,
}

impl Spans<'_> {
    /// How data is placed into these spans: strict if any pinned registration is strict
    /// (inline bytes and empty lists are never written into, so strict is moot there).
    pub(crate) fn placement(&self) -> Placement {
        self.pins
            .iter()
            .map(Pin::placement)
            .min()
            .unwrap_or(Placement::Strict)
    }
}

thread_local! {
    /// Span lists of finished work requests, kept for the next ones: a layout can resolve to
    /// thousands of spans per request, and allocating (and faulting in) that list anew each
    /// time cost more than resolving it.
    static SPAN_LISTS: std::cell::RefCell<Vec<Vec<Span>>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Span lists kept per thread, and the largest kept (in spans: 1.5 MiB).
const KEPT_LISTS: usize = 4;
const KEPT_SPANS: usize = 1 << 16;

/// Makes room in `spans` for `n` more, taking a kept list when one is at hand. Only layouts
/// need it: an ordinary request's short list is cheaper to allocate than to fetch from the
/// thread's store.
fn reserve_spans(spans: &mut Vec<Span>, n: usize) {
    if spans.capacity() - spans.len() >= n {
        return;
    }
    if let Some(mut kept) = SPAN_LISTS.with(|l| l.borrow_mut().pop()) {
        kept.clear();
        kept.extend_from_slice(spans);
        std::mem::swap(spans, &mut kept);
    }
    spans.reserve(n);
}

impl Drop for Spans<'_> {
    fn drop(&mut self) {
        let Few::Heap(mut v) = std::mem::take(&mut self.spans) else {
            return;
        };
        if v.capacity() > 8 && v.capacity() <= KEPT_SPANS {
            v.clear();
            SPAN_LISTS.with(|l| {
                let mut l = l.borrow_mut();
                if l.len() < KEPT_LISTS {
                    l.push(v);
                }
            });
        }
    }
}

/// Checks and pins `sges` in `keys`; `place` says where each pinned range is reachable. An
/// SGE whose key is a non-contiguous layout becomes the spans of its pieces. `by`: how the
/// pins hold deregistration off (see [`KeyTable::pin_key`]; a layout's pieces always count).
#[inline]
pub(crate) fn pin_sges<'k>(
    keys: &'k KeyTable,
    pd: u32,
    sges: &[Sge],
    need: AccessFlags,
    by: PinBy<'_>,
    place: impl Fn(&Pin<'_>, usize, usize) -> Option<Span>,
) -> Result<Spans<'k>, KeyError> {
    // Nearly every request: one SGE of an ordinary key, built in place.
    if let [s] = sges
        && s.length > 0
    {
        let n = u64::from(s.length);
        match keys.pin_key(s.lkey, pd, None, s.addr, n, need, by) {
            Ok(pin) => {
                let span = place(&pin, pin.host, s.length as usize).ok_or(KeyError::Invalid)?;
                return Ok(Spans {
                    spans: Few::Inline(Some(span)),
                    pins: Few::Inline(Some(pin)),
                    len: n,
                });
            }
            Err(KeyError::Layout) => {}
            Err(e) => return Err(e),
        }
    }
    let mut spans = Few::new();
    let mut pins = Few::new();
    let mut len = 0u64;
    for s in sges.iter().filter(|s| s.length > 0) {
        let n = u64::from(s.length);
        match keys.pin_key(s.lkey, pd, None, s.addr, n, need, by) {
            Ok(pin) => {
                spans.push(place(&pin, pin.host, s.length as usize).ok_or(KeyError::Invalid)?);
                pins.push(pin);
            }
            Err(KeyError::Layout) => resolve_layout(
                keys,
                pd,
                s.lkey,
                s.addr,
                n,
                need,
                &place,
                spans.as_vec(),
                pins.as_vec(),
                1,
            )?,
            Err(e) => return Err(e),
        }
        len += n;
    }
    Ok(Spans { spans, pins, len })
}

/// Checks and pins `len` bytes of rkey `key` at `addr` in `keys` with `pd` and `need`, for
/// a request that reached QP `qpn` (a region's key, or a window's); `place` says where
/// pinned ranges are reachable; `by`: how the pin holds deregistration off. A layout key
/// resolves to its pieces (which count). `None` is an access error of the side that named
/// the key.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn pin_range<'k>(
    keys: &'k KeyTable,
    pd: u32,
    qpn: u32,
    key: u32,
    addr: u64,
    len: u64,
    need: AccessFlags,
    by: PinBy<'_>,
    place: impl Fn(&Pin<'_>, usize, usize) -> Option<Span>,
) -> Option<Pinned<'k>> {
    match keys.pin_key(key, pd, Some(qpn), addr, len, need, by) {
        Ok(pin) => {
            let span = place(&pin, pin.host, len as usize)?;
            Some(Pinned::One(pin, span))
        }
        Err(KeyError::Layout) => {
            let (mut spans, mut pins) = (Vec::new(), Vec::new());
            resolve_layout(
                keys, pd, key, addr, len, need, &place, &mut spans, &mut pins, 1,
            )
            .ok()?;
            Some(Pinned::Many(Spans {
                spans: Few::Heap(spans),
                pins: Few::Heap(pins),
                len,
            }))
        }
        Err(_) => None,
    }
}

/// Most pieces one side of one work request may resolve to: a bound on the memory a
/// pathological layout (1-byte data over a 2 GiB message) can make the data path allocate.
pub const MAX_PIECES: usize = 1 << 20;

/// Deepest layout nesting the data path follows (a layout over plain MRs is level 1).
pub const MAX_LEVEL: u32 = LayoutCaps::DEFAULT_MAX_NESTING_LEVEL;

/// Resolves `[iova, iova + len)` of layout region `key` into spans, pinning the container and
/// every piece (with `pd` and `need`) into `pins`. `level` is 1 for a key named by a work
/// request. Any failure is the key error the caller reports as a protection or
/// remote-access status; `spans`/`pins` may then hold a partial result, which the caller
/// drops. `place` says where a pinned host range `(pin, host, len)` is reachable from this
/// process; it is a type parameter, not a `dyn Fn`, so it inlines into the per-piece loop (an
/// indirect call per 8-byte cell, returning its span through memory, cost more than the rest
/// of the loop).
#[allow(clippy::too_many_arguments)]
pub(crate) fn resolve_layout<'k, P>(
    keys: &'k KeyTable,
    pd: u32,
    key: u32,
    iova: u64,
    len: u64,
    need: AccessFlags,
    place: &P,
    spans: &mut Vec<Span>,
    pins: &mut Vec<Pin<'k>>,
    level: u32,
) -> std::result::Result<(), KeyError>
where
    P: Fn(&Pin<'_>, usize, usize) -> Option<Span> + ?Sized,
{
    if level > MAX_LEVEL {
        return Err(KeyError::Bounds);
    }
    let (cpin, r) = keys.pin_layout(key, pd, iova, len, need)?;
    let layout = store::compiled(&r, key).ok_or(KeyError::Invalid)?;
    // Room for every piece at once: a column of 4096 cells would otherwise regrow (and
    // copy) the list a dozen times per work request.
    let room = layout.max_pieces(len).min(MAX_PIECES as u64) as usize;
    reserve_spans(spans, room.min(MAX_PIECES.saturating_sub(spans.len())));
    let container = pins.len();
    pins.push(cpin);
    // The pin of the last plain region a piece was in: consecutive pieces of one region
    // (the usual case: a column of one matrix) share it instead of pinning again.
    let mut last: Option<usize> = None;
    let visit = |run: crate::mr::layout::Run| -> std::result::Result<(), KeyError> {
        if spans.len() >= MAX_PIECES {
            return Err(KeyError::Bounds);
        }
        // A run is `count` data of `len` bytes, `stride` apart: checked, pinned and placed
        // as the one range from its first byte to its last, then described as a strided span.
        let extent = run
            .count
            .checked_sub(1)
            .and_then(|c| c.checked_mul(run.stride))
            .and_then(|b| b.checked_add(run.len))
            .ok_or(KeyError::Bounds)?;
        let (len, count, stride) = (
            usize::try_from(run.len).map_err(|_| KeyError::Bounds)?,
            usize::try_from(run.count).map_err(|_| KeyError::Bounds)?,
            usize::try_from(run.stride).map_err(|_| KeyError::Bounds)?,
        );
        let n = usize::try_from(extent).map_err(|_| KeyError::Bounds)?;
        let strided = |s: Span| Span {
            len,
            count,
            stride,
            ..s
        };
        if run.key == PLAIN_KEY {
            // An owner buffer registered with the layout: covered by the container's pin
            // and rights (checked above).
            let host = usize::try_from(run.addr).map_err(|_| KeyError::Bounds)?;
            if host.checked_add(n).is_none() {
                return Err(KeyError::Bounds);
            }
            let s = place(&pins[container], host, n).ok_or(KeyError::Invalid)?;
            spans.push(strided(s));
            return Ok(());
        }
        if let Some(i) = last
            && pins[i].key() == run.key
            && let Some(host) = pins[i].rebase(run.addr, extent)
        {
            spans.push(strided(place(&pins[i], host, n).ok_or(KeyError::Invalid)?));
            return Ok(());
        }
        match keys.pin(run.key, pd, run.addr, extent, need) {
            Ok(pin) => {
                spans.push(strided(place(&pin, pin.host, n).ok_or(KeyError::Invalid)?));
                pins.push(pin);
                last = Some(pins.len() - 1);
                Ok(())
            }
            Err(KeyError::Layout) => {
                last = None;
                // Data of a nested layout: each a range of it, resolved in turn.
                (0..run.count).try_for_each(|i| {
                    // In range: `i * stride` is at most `extent`, checked above.
                    let addr = run
                        .addr
                        .checked_add(i * run.stride)
                        .ok_or(KeyError::Bounds)?;
                    resolve_layout(
                        keys,
                        pd,
                        run.key,
                        addr,
                        run.len,
                        need,
                        place,
                        spans,
                        pins,
                        level + 1,
                    )
                })
            }
            Err(e) => Err(e),
        }
    };
    layout
        .try_for_each_run(r.offset, len, visit)
        .map_err(|_| KeyError::Bounds)?
}

#[cfg(test)]
mod tests {
    use super::Few;

    #[test]
    fn a_few_list_extends_like_a_vec() {
        for (start, more) in [(0, 0), (0, 1), (0, 3), (1, 0), (1, 1), (1, 4), (3, 2)] {
            let mut few = Few::new();
            let mut vec = Vec::new();
            few.extend(0..start);
            vec.extend(0..start);
            few.extend(10..10 + more);
            vec.extend(10..10 + more);
            assert_eq!(&*few, &vec[..], "{start} then {more}");
        }
    }
}
