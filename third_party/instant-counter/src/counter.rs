//! The counter clock of the Wasm sandbox.

use std::ops::{Add, AddAssign, Sub, SubAssign};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// The last tick handed out.
static TICKS: AtomicU64 = AtomicU64::new(0);

/// A point on the counter clock: one tick per `now()`, each worth a nanosecond.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Instant {
    ticks: u64,
}

impl Instant {
    /// The next tick.
    pub fn now() -> Instant {
        Instant {
            ticks: TICKS.fetch_add(1, Ordering::Relaxed) + 1,
        }
    }

    /// Ticks from `earlier` to `self`, zero if `earlier` is later.
    pub fn duration_since(&self, earlier: Instant) -> Duration {
        self.saturating_duration_since(earlier)
    }

    pub fn saturating_duration_since(&self, earlier: Instant) -> Duration {
        Duration::from_nanos(self.ticks.saturating_sub(earlier.ticks))
    }

    pub fn checked_duration_since(&self, earlier: Instant) -> Option<Duration> {
        self.ticks
            .checked_sub(earlier.ticks)
            .map(Duration::from_nanos)
    }

    /// Ticks since `self`.
    pub fn elapsed(&self) -> Duration {
        Instant::now().duration_since(*self)
    }

    pub fn checked_add(&self, d: Duration) -> Option<Instant> {
        let n = u64::try_from(d.as_nanos()).ok()?;
        self.ticks.checked_add(n).map(|ticks| Instant { ticks })
    }

    pub fn checked_sub(&self, d: Duration) -> Option<Instant> {
        let n = u64::try_from(d.as_nanos()).ok()?;
        self.ticks.checked_sub(n).map(|ticks| Instant { ticks })
    }
}

impl Add<Duration> for Instant {
    type Output = Instant;
    fn add(self, d: Duration) -> Instant {
        self.checked_add(d)
            .expect("overflow when adding a duration to an instant")
    }
}

impl AddAssign<Duration> for Instant {
    fn add_assign(&mut self, d: Duration) {
        *self = *self + d;
    }
}

impl Sub<Duration> for Instant {
    type Output = Instant;
    fn sub(self, d: Duration) -> Instant {
        self.checked_sub(d)
            .expect("overflow when subtracting a duration from an instant")
    }
}

impl SubAssign<Duration> for Instant {
    fn sub_assign(&mut self, d: Duration) {
        *self = *self - d;
    }
}

impl Sub<Instant> for Instant {
    type Output = Duration;
    fn sub(self, earlier: Instant) -> Duration {
        self.duration_since(earlier)
    }
}
