//! Counting another transport's generations (claudelink) in the gateway's in-flight gauge, so
//! `/metrics` and [`Gateway::in_flight`] (which the server's drain waits on) see every stream.

use std::sync::Arc;

use futures::StreamExt;

use super::core::Gateway;
use super::metrics::GatewayMetrics;
use zerolayer_api::{
    EventStream, InferenceRequest, InferenceService, ModelInfo, Prompt, ServiceError,
    ServiceHealth, ServiceMetrics,
};

/// Delegates to a service and counts each accepted request in flight until its stream is
/// dropped.
struct CountedService {
    inner: Arc<dyn InferenceService>,
    metrics: Arc<GatewayMetrics>,
}

/// One counted stream; uncounted when dropped.
struct InFlight(Arc<GatewayMetrics>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.other_ended();
    }
}

impl InferenceService for CountedService {
    fn submit(&self, request: InferenceRequest) -> Result<EventStream, ServiceError> {
        let events = self.inner.submit(request)?;
        self.metrics.other_started();
        let counted = InFlight(self.metrics.clone());
        Ok(Box::pin(events.map(move |ev| {
            let _counted = &counted;
            ev
        })))
    }

    fn count_tokens(&self, prompt: &Prompt) -> Result<u32, ServiceError> {
        self.inner.count_tokens(prompt)
    }

    fn models(&self) -> Vec<ModelInfo> {
        self.inner.models()
    }

    fn metrics(&self) -> ServiceMetrics {
        self.inner.metrics()
    }

    fn ready(&self) -> bool {
        self.inner.ready()
    }

    fn health(&self) -> ServiceHealth {
        self.inner.health()
    }
}

impl Gateway {
    /// Wraps `service` so that the requests another transport (the claudelink server) submits
    /// through it count in this gateway's in-flight gauge (`zerolayer_generations_in_flight`
    /// and [`Gateway::in_flight`]) while their streams live. They do not count toward
    /// `max_concurrent_requests`, which limits the gateway's own requests.
    ///
    /// ```
    /// # use std::sync::Arc;
    /// # use zerolayer_api::InferenceService;
    /// # use zerolayer_gateway::{Gateway, GatewayConfig};
    /// # fn f(service: Arc<dyn InferenceService>) {
    /// let gateway = Gateway::new(service.clone(), GatewayConfig::default());
    /// let for_claudelink: Arc<dyn InferenceService> = gateway.count_in_flight(service);
    /// assert_eq!(gateway.in_flight(), 0);
    /// # }
    /// ```
    pub fn count_in_flight(&self, service: Arc<dyn InferenceService>) -> Arc<dyn InferenceService> {
        Arc::new(CountedService {
            inner: service,
            metrics: self.inner.metrics.clone(),
        })
    }
}
