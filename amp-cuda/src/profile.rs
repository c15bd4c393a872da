//! Kernel timings for [`amp_core::profile`]: while a profile records, each launch, cuBLAS
//! call, memset and copy on the device's stream is bracketed by two timing events, resolved
//! when the profile stops. When none records, a span costs one atomic load.
//!
//! The events time the stream, not the kernel alone: when the GPU sits idle waiting for the
//! host, a span also covers the host's time between recording its start and its launch.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use cudarc::driver::CudaEvent;
use cudarc::driver::sys::CUevent_flags;

use crate::device::State;

/// An open span: the start event, when a profile records.
pub(crate) struct Span(Option<CudaEvent>);

impl Span {
    /// Records the start event if a profile is recording.
    pub(crate) fn begin(st: &State) -> Span {
        if !amp_core::profile::is_recording() {
            return Span(None);
        }
        Span(st.stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).ok())
    }

    /// Records the end event and hands the pair to the profile under `name()`.
    pub(crate) fn end(self, st: &State, name: impl FnOnce() -> String) {
        let Some(start) = self.0 else { return };
        if let Ok(end) = st.stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT)) {
            let waits = st.waits.clone();
            amp_core::profile::record_pending(Box::new(EventPair { name: name(), start, end, waits }));
        }
    }
}

/// A timed span waiting for the device.
struct EventPair {
    name: String,
    start: CudaEvent,
    end: CudaEvent,
    waits: Arc<AtomicU64>,
}

impl amp_core::profile::PendingTime for EventPair {
    fn resolve(self: Box<Self>) -> (String, f64) {
        if !self.end.is_complete() {
            self.waits.fetch_add(1, Ordering::Relaxed); // the wait the profile's reader asked for
        }
        let seconds = self.start.elapsed_ms(&self.end).map_or(f64::NAN, |ms| ms as f64 / 1e3);
        (self.name, seconds)
    }
}
