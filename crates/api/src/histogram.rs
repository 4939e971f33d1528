//! The histogram every layer records distributions in (latencies, rates, batch sizes).

use std::time::Duration;

/// A histogram over fixed bucket upper bounds, Prometheus style: an observation `x` falls in
/// the first bucket whose bound `le` satisfies `x <= le`, or only in the implicit `+Inf` bucket
/// when it exceeds the last bound (NaN too). It keeps a count per bucket, the number of
/// observations and their sum.
///
/// The sum is kept in whole millionths of the unit (each observation is truncated to that
/// resolution, negative ones count as 0): integer addition, exact and order-independent; a
/// duration in seconds is summed in microseconds. [`sum`](Self::sum) gives it back in the unit.
///
/// A plain value: [`observe`](Self::observe) takes `&mut self`, a snapshot is a `clone`. A
/// recorder shared between threads puts it behind a lock; observing is a bounds scan and three
/// additions, no allocation.
///
/// ```
/// use std::time::Duration;
/// use zerolayer_api::Histogram;
///
/// let mut h = Histogram::new(Histogram::LATENCY_SECONDS);
/// h.observe_duration(Duration::from_millis(3));
/// h.observe_duration(Duration::from_millis(200));
/// h.observe(1000.0); // above the last bound (300 s): counted, in no finite bucket
///
/// assert_eq!(h.count(), 3);
/// assert_eq!(h.sum(), 1000.203);
/// // Cumulative counts per bound, as in Prometheus' `_bucket{le=".."}` series.
/// let le = |b: f64| h.cumulative().find(|&(le, _)| le == b).unwrap().1;
/// assert_eq!((le(0.001), le(0.005), le(0.25), le(300.0)), (0, 1, 2, 2));
/// // The median is at most 250 ms (the resolution of the buckets: 200 ms lies in (0.1, 0.25]).
/// assert_eq!(h.quantile_upper_bound(0.5), Some(0.25));
/// assert_eq!(h.mean(), Some(1000.203 / 3.0));
/// assert_eq!(h.quantile_upper_bound(1.0), Some(f64::INFINITY));
/// assert_eq!(Histogram::new(&[1.0]).mean(), None);
/// ```
#[derive(Clone, Debug, PartialEq)]
pub struct Histogram {
    /// Bucket upper bounds, strictly increasing.
    bounds: &'static [f64],
    /// Observations per finite bucket (not cumulative), one per bound.
    counts: Vec<u64>,
    /// All observations, `+Inf` bucket included.
    count: u64,
    /// Sum of the observations in millionths of the unit.
    sum_micros: u64,
}

impl Histogram {
    /// Latency bounds in seconds, 1 ms to 5 min (Prometheus' default buckets, widened):
    /// 1, 2.5, 5, 10, 25, 50, 100, 250, 500 ms; 1, 2.5, 5, 10, 30, 60, 300 s.
    pub const LATENCY_SECONDS: &'static [f64] = &[
        0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
        300.0,
    ];

    /// An empty histogram over `bounds`.
    ///
    /// # Panics
    /// When `bounds` is not strictly increasing or holds NaN.
    pub fn new(bounds: &'static [f64]) -> Self {
        assert!(
            bounds.windows(2).all(|w| w[0] < w[1]) && bounds.iter().all(|b| !b.is_nan()),
            "histogram bounds must be strictly increasing: {bounds:?}"
        );
        Self {
            bounds,
            counts: vec![0; bounds.len()],
            count: 0,
            sum_micros: 0,
        }
    }

    /// Records one observation.
    pub fn observe(&mut self, x: f64) {
        if let Some(i) = self.bounds.iter().position(|&b| x <= b) {
            self.counts[i] += 1;
        }
        self.count += 1;
        self.sum_micros = self.sum_micros.saturating_add((x.max(0.0) * 1e6) as u64);
    }

    /// Records a duration in seconds (`observe(d.as_secs_f64())`).
    pub fn observe_duration(&mut self, d: Duration) {
        self.observe(d.as_secs_f64());
    }

    /// The bucket upper bounds.
    pub fn bounds(&self) -> &'static [f64] {
        self.bounds
    }

    /// Number of observations.
    pub fn count(&self) -> u64 {
        self.count
    }

    /// Sum of the observations (at a resolution of a millionth of the unit).
    pub fn sum(&self) -> f64 {
        self.sum_micros as f64 / 1e6
    }

    /// Mean of the observations, `None` without any.
    pub fn mean(&self) -> Option<f64> {
        (self.count > 0).then(|| self.sum() / self.count as f64)
    }

    /// Each bound with the number of observations at most that bound, in increasing order
    /// (the implicit `+Inf` bucket, which holds [`count`](Self::count), is not listed).
    pub fn cumulative(&self) -> impl Iterator<Item = (f64, u64)> + '_ {
        self.bounds
            .iter()
            .zip(&self.counts)
            .scan(0, |seen, (&le, &c)| {
                *seen += c;
                Some((le, *seen))
            })
    }

    /// The upper bound of the bucket that holds quantile `q` (clamped to [0, 1]): at least a
    /// fraction `q` of the observations are at most this value. `f64::INFINITY` when that
    /// bucket is `+Inf`; `None` without observations.
    pub fn quantile_upper_bound(&self, q: f64) -> Option<f64> {
        if self.count == 0 {
            return None;
        }
        let target = ((q.clamp(0.0, 1.0) * self.count as f64).ceil() as u64).max(1);
        let bound = self
            .cumulative()
            .find(|&(_, seen)| seen >= target)
            .map_or(f64::INFINITY, |(le, _)| le);
        Some(bound)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounds_are_inclusive_and_overflow_goes_to_inf_only() {
        let mut h = Histogram::new(&[1.0, 2.0]);
        for x in [1.0, 1.5, 2.0, 2.5, f64::NAN] {
            h.observe(x);
        }
        assert_eq!(h.cumulative().collect::<Vec<_>>(), [(1.0, 1), (2.0, 3)]);
        assert_eq!(h.count(), 5);
        assert_eq!(h.sum(), 7.0);
    }

    #[test]
    fn negative_observations_add_nothing_to_the_sum() {
        let mut h = Histogram::new(&[0.0, 1.0]);
        h.observe(-3.0);
        h.observe(0.5);
        assert_eq!(h.cumulative().collect::<Vec<_>>(), [(0.0, 1), (1.0, 2)]);
        assert_eq!(h.sum(), 0.5);
        assert_eq!(h.mean(), Some(0.25));
    }

    #[test]
    fn quantiles_walk_the_cumulative_counts() {
        let mut h = Histogram::new(&[1.0, 3.0, 7.0]);
        for x in [1.0, 2.0, 3.0, 5.0, 100.0] {
            h.observe(x);
        }
        assert_eq!(h.quantile_upper_bound(0.0), Some(1.0));
        assert_eq!(h.quantile_upper_bound(0.2), Some(1.0));
        assert_eq!(h.quantile_upper_bound(0.6), Some(3.0));
        assert_eq!(h.quantile_upper_bound(0.8), Some(7.0));
        assert_eq!(h.quantile_upper_bound(0.81), Some(f64::INFINITY));
        assert_eq!(Histogram::new(&[1.0]).quantile_upper_bound(0.5), None);
    }

    #[test]
    fn durations_are_summed_in_microseconds() {
        let mut h = Histogram::new(Histogram::LATENCY_SECONDS);
        h.observe_duration(Duration::from_micros(1500));
        h.observe_duration(Duration::from_secs(2));
        assert_eq!(h.sum(), 2.0015);
        assert_eq!(h.mean(), Some(1.00075));
    }

    #[test]
    #[should_panic(expected = "strictly increasing")]
    fn unordered_bounds_are_refused() {
        let _ = Histogram::new(&[2.0, 1.0]);
    }
}
