// SPDX-License-Identifier: Apache-2.0
//! KV cache events (`kvport_*_enable_events`): a [`PrefixCache`] or a
//! [`HybridKvCache`] publishes every change of the blocks it holds as vLLM's
//! KV events (BlockStored, BlockRemoved, AllBlocksCleared) on a ZeroMQ PUB
//! socket, in vLLM's wire format, so that llm-d's and Dynamo's routers can
//! follow it (docs/events.md). The publisher belongs to the cache: it is
//! destroyed by `disable_events` or with the cache.

use std::ffi::CString;
use std::os::raw::c_char;
use std::ptr;
use std::time::Duration;

use crate::error::{check, KvError};
use crate::ffi;
use crate::hybrid::HybridKvCache;
use crate::prefix::PrefixCache;

/// How the events are encoded (`kvport_event_form`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EventForm {
    /// Map-tagged events (vLLM since mid-2026).
    Map,
    /// Positional arrays with the tag first (vLLM before).
    Positional,
}

/// How the publisher binds and batches (`kvport_events_options`). A zero
/// count or duration takes the publisher's default (docs/events.md).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EventsOptions {
    /// The PUB socket's endpoint; port 0 binds an ephemeral port
    /// ([`PrefixCache::events_endpoint`] says which).
    pub endpoint: String,
    /// The first frame of every message (empty: vLLM's default).
    pub topic: String,
    /// The ROUTER socket for replay and snapshot requests.
    pub replay_endpoint: Option<String>,
    /// The batches' third element (nil when `None`).
    pub data_parallel_rank: Option<i64>,
    pub form: EventForm,
    pub max_batch_events: usize,
    pub batch_interval: Duration,
    pub buffer_events: usize,
    pub buffer_bytes: usize,
    pub send_high_water_mark: i32,
    pub replay_ring_batches: usize,
    /// How long destroying the publisher waits for queued sends.
    pub linger: Duration,
}

impl EventsOptions {
    /// Defaults with `endpoint`.
    pub fn new(endpoint: &str) -> EventsOptions {
        EventsOptions {
            endpoint: endpoint.to_string(),
            topic: String::new(),
            replay_endpoint: None,
            data_parallel_rank: None,
            form: EventForm::Map,
            max_batch_events: 0,
            batch_interval: Duration::ZERO,
            buffer_events: 0,
            buffer_bytes: 0,
            send_high_water_mark: 0,
            replay_ring_batches: 0,
            linger: Duration::ZERO,
        }
    }
}

impl Default for EventsOptions {
    /// `tcp://127.0.0.1:5557`, no topic, no replay socket, map form.
    fn default() -> EventsOptions {
        EventsOptions::new("tcp://127.0.0.1:5557")
    }
}

/// A publisher's counters (`kvport_events_stats`).
pub type EventsStats = ffi::kvport_events_stats;

/// Which socket's endpoint to report.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Socket {
    Pub,
    Replay,
}

fn c_string(s: &str, what: &str) -> Result<CString, KvError> {
    CString::new(s).map_err(|_| KvError::InvalidArgument(format!("{} contains a NUL byte", what)))
}

/// Calls `f` with `o` as the C struct (its strings alive during the call).
fn with_options(
    o: &EventsOptions,
    f: impl FnOnce(*const ffi::kvport_events_options) -> ffi::kvport_status,
) -> Result<(), KvError> {
    let endpoint = c_string(&o.endpoint, "endpoint")?;
    let topic = c_string(&o.topic, "topic")?;
    let replay = match &o.replay_endpoint {
        Some(r) => Some(c_string(r, "replay_endpoint")?),
        None => None,
    };
    let c = ffi::kvport_events_options {
        endpoint: endpoint.as_ptr(),
        topic: topic.as_ptr(),
        replay_endpoint: replay.as_ref().map_or(ptr::null(), |r| r.as_ptr()),
        has_data_parallel_rank: o.data_parallel_rank.is_some(),
        data_parallel_rank: o.data_parallel_rank.unwrap_or(0),
        form: match o.form {
            EventForm::Map => ffi::KVPORT_EVENT_FORM_MAP,
            EventForm::Positional => ffi::KVPORT_EVENT_FORM_POSITIONAL,
        },
        max_batch_events: o.max_batch_events,
        batch_interval_us: o.batch_interval.as_micros().min(u64::MAX as u128) as u64,
        buffer_events: o.buffer_events,
        buffer_bytes: o.buffer_bytes,
        send_high_water_mark: o.send_high_water_mark,
        replay_ring_batches: o.replay_ring_batches,
        linger_ms: o.linger.as_millis().min(u32::MAX as u128) as u32,
    };
    check(f(&c))
}

type EndpointFn<T> = unsafe extern "C" fn(*const T, i32, *mut c_char, usize, *mut usize) -> ffi::kvport_status;

fn endpoint_of<T>(raw: *const T, f: EndpointFn<T>, socket: Socket) -> Result<String, KvError> {
    let which = match socket {
        Socket::Pub => ffi::KVPORT_EVENTS_SOCKET_PUB,
        Socket::Replay => ffi::KVPORT_EVENTS_SOCKET_REPLAY,
    };
    let mut needed = 0usize;
    check(unsafe { f(raw, which, ptr::null_mut(), 0, &mut needed) })?;
    let mut text = vec![0u8; needed.max(1)];
    check(unsafe { f(raw, which, text.as_mut_ptr() as *mut c_char, text.len(), ptr::null_mut()) })?;
    let len = text.iter().position(|&b| b == 0).unwrap_or(text.len());
    text.truncate(len);
    Ok(String::from_utf8_lossy(&text).into_owned())
}

fn timeout_ms(timeout: Duration) -> u32 {
    timeout.as_millis().min(u32::MAX as u128) as u32
}

impl<'c> PrefixCache<'c> {
    /// Starts publishing this prefix cache's events (medium "GPU"), then
    /// announces the blocks cached already. `InvalidArgument` for a bad
    /// option, an endpoint ZeroMQ cannot parse or bind, or when events are
    /// enabled already.
    pub fn enable_events(&self, options: &EventsOptions) -> Result<(), KvError> {
        with_options(options, |o| unsafe { ffi::kvport_prefix_cache_enable_events(self.raw(), o) })
    }
    /// Announces AllBlocksCleared and destroys the publisher (after it sent
    /// what it buffered). Nothing when events are not enabled.
    pub fn disable_events(&self) -> Result<(), KvError> {
        check(unsafe { ffi::kvport_prefix_cache_disable_events(self.raw()) })
    }
    /// The publisher's counters; `InvalidArgument` when events are not enabled.
    pub fn events_stats(&self) -> Result<EventsStats, KvError> {
        let mut s = EventsStats::default();
        check(unsafe { ffi::kvport_prefix_cache_events_stats(self.raw(), &mut s) })?;
        Ok(s)
    }
    /// The PUB socket's bound endpoint (the real port for port 0).
    pub fn events_endpoint(&self) -> Result<String, KvError> {
        endpoint_of(self.raw(), ffi::kvport_prefix_cache_events_endpoint, Socket::Pub)
    }
    /// The replay socket's bound endpoint; `None` without one.
    pub fn events_replay_endpoint(&self) -> Result<Option<String>, KvError> {
        let e = endpoint_of(self.raw(), ffi::kvport_prefix_cache_events_endpoint, Socket::Replay)?;
        Ok(if e.is_empty() { None } else { Some(e) })
    }
    /// Waits until every event announced before the call is published, at
    /// most `timeout` (whole milliseconds); `false` when that took longer.
    pub fn flush_events(&self, timeout: Duration) -> Result<bool, KvError> {
        let mut flushed = false;
        check(unsafe { ffi::kvport_prefix_cache_flush_events(self.raw(), timeout_ms(timeout), &mut flushed) })?;
        Ok(flushed)
    }
}

impl HybridKvCache {
    /// As [`PrefixCache::enable_events`], for every group: each event
    /// carries its group_idx, kv_cache_spec_kind and sliding window.
    pub fn enable_events(&self, options: &EventsOptions) -> Result<(), KvError> {
        with_options(options, |o| unsafe { ffi::kvport_hybrid_cache_enable_events(self.raw(), o) })
    }
    /// As [`PrefixCache::disable_events`] (one AllBlocksCleared per group).
    pub fn disable_events(&self) -> Result<(), KvError> {
        check(unsafe { ffi::kvport_hybrid_cache_disable_events(self.raw()) })
    }
    pub fn events_stats(&self) -> Result<EventsStats, KvError> {
        let mut s = EventsStats::default();
        check(unsafe { ffi::kvport_hybrid_cache_events_stats(self.raw(), &mut s) })?;
        Ok(s)
    }
    pub fn events_endpoint(&self) -> Result<String, KvError> {
        endpoint_of(self.raw(), ffi::kvport_hybrid_cache_events_endpoint, Socket::Pub)
    }
    pub fn events_replay_endpoint(&self) -> Result<Option<String>, KvError> {
        let e = endpoint_of(self.raw(), ffi::kvport_hybrid_cache_events_endpoint, Socket::Replay)?;
        Ok(if e.is_empty() { None } else { Some(e) })
    }
    pub fn flush_events(&self, timeout: Duration) -> Result<bool, KvError> {
        let mut flushed = false;
        check(unsafe { ffi::kvport_hybrid_cache_flush_events(self.raw(), timeout_ms(timeout), &mut flushed) })?;
        Ok(flushed)
    }
}
