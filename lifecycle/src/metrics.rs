//! The lifecycle's metrics: its HTTP requests (API and gateway, through
//! `sandbolt_telemetry::http_layer`) and the create latencies SDKs report on
//! `POST /metrics/events` — the client's view of a create, which the
//! server-side histograms cannot see (connection set-up, readiness polling).

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use sandbolt_telemetry::HttpMetrics;
use sandbolt_telemetry::prometheus_client::metrics::counter::Counter;
use sandbolt_telemetry::prometheus_client::metrics::family::Family;
use sandbolt_telemetry::prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use sandbolt_telemetry::prometheus_client::registry::Registry;
use serde_json::{Map, Value, json};

/// The `component` label of the lifecycle's HTTP metrics.
pub const COMPONENT: &str = "lifecycle";

/// The one event type of the OpenSandbox `MetricsEvent` schema.
pub const SANDBOX_CREATE_EVENT: &str = "sandbox.create";

type EventLabels = [(&'static str, &'static str); 2];
type OutcomeLabels = [(&'static str, &'static str); 1];

/// Everything the lifecycle counts, registered into one registry (its own
/// ops port, or the shared one of `sandbolt up`).
#[derive(Clone, Debug)]
pub struct LifecycleMetrics {
    pub(crate) http: HttpMetrics,
    pub(crate) sdk: SdkMetrics,
}

impl LifecycleMetrics {
    /// Registers the lifecycle's families into `reg`.
    pub fn register(reg: &mut Registry) -> Self {
        Self {
            http: HttpMetrics::register(reg, COMPONENT),
            sdk: SdkMetrics::register(reg),
        }
    }
}

/// What SDKs report: `sandbolt_lifecycle_sdk_events_total{event,outcome}` and
/// `sandbolt_lifecycle_sdk_create_duration_seconds{outcome}`.
#[derive(Clone, Debug)]
pub(crate) struct SdkMetrics {
    events: Family<EventLabels, Counter>,
    create_duration: Family<OutcomeLabels, Histogram, fn() -> Histogram>,
}

/// 10 ms to ~82 s: a create as a client sees it, image pulls included.
fn create_duration_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.01, 2.0, 14))
}

impl SdkMetrics {
    fn register(reg: &mut Registry) -> Self {
        let events = Family::<EventLabels, Counter>::default();
        let create_duration =
            Family::<OutcomeLabels, Histogram, fn() -> Histogram>::new_with_constructor(
                create_duration_histogram,
            );
        reg.register(
            "sandbolt_lifecycle_sdk_events",
            "Metrics events SDKs reported on POST /metrics/events, by event type and outcome",
            events.clone(),
        );
        reg.register(
            "sandbolt_lifecycle_sdk_create_duration_seconds",
            "Create-to-ready time of sandbox creates as SDKs measured and reported them",
            create_duration.clone(),
        );
        Self {
            events,
            create_duration,
        }
    }

    fn record(&self, event: &MetricsEvent) {
        let outcome = if event.success { "ok" } else { "error" };
        self.events
            .get_or_create(&[("event", SANDBOX_CREATE_EVENT), ("outcome", outcome)])
            .inc();
        self.create_duration
            .get_or_create(&[("outcome", outcome)])
            .observe(event.create_duration_ms as f64 / 1000.0);
    }
}

/// An OpenSandbox `MetricsEvent` (its only `eventType` is `sandbox.create`).
#[derive(Debug, Clone, PartialEq)]
pub struct MetricsEvent {
    pub sandbox_id: Option<String>,
    pub image: Option<String>,
    pub create_duration_ms: u64,
    pub success: bool,
}

/// One entry of the contract's `HTTPValidationError.detail`.
fn violation(field: Option<&str>, kind: &str, msg: &str, input: Option<&Value>) -> Value {
    let loc = match field {
        Some(f) => json!(["body", f]),
        None => json!(["body"]),
    };
    let mut v = json!({"type": kind, "loc": loc, "msg": msg});
    if let Some(input) = input {
        v["input"] = input.clone();
    }
    v
}

/// Parses a `MetricsEvent` body, or answers every violation the way the
/// contract documents for this route (422, `{"detail": [{loc, msg, type}]}`).
pub fn parse_metrics_event(body: &[u8]) -> Result<MetricsEvent, Vec<Value>> {
    let value: Value = serde_json::from_slice(body).map_err(|e| {
        vec![violation(
            None,
            "json_invalid",
            &format!("JSON decode error: {e}"),
            None,
        )]
    })?;
    let Some(obj) = value.as_object() else {
        return Err(vec![violation(
            None,
            "model_attributes_type",
            "Input should be a valid dictionary or object to extract fields from",
            Some(&value),
        )]);
    };
    let mut errors = Vec::new();
    match obj.get("eventType") {
        None => errors.push(violation(
            Some("eventType"),
            "missing",
            "Field required",
            None,
        )),
        Some(Value::String(s)) if s == SANDBOX_CREATE_EVENT => {}
        Some(other) => errors.push(violation(
            Some("eventType"),
            "literal_error",
            "Input should be 'sandbox.create'",
            Some(other),
        )),
    }
    let create_duration_ms = duration_field(obj, &mut errors);
    let success = match obj.get("success") {
        None => {
            errors.push(violation(
                Some("success"),
                "missing",
                "Field required",
                None,
            ));
            None
        }
        Some(Value::Bool(b)) => Some(*b),
        Some(other) => {
            errors.push(violation(
                Some("success"),
                "bool_type",
                "Input should be a valid boolean",
                Some(other),
            ));
            None
        }
    };
    let sandbox_id = optional_string(obj, "sandboxId", &mut errors);
    let image = optional_string(obj, "image", &mut errors);
    match (create_duration_ms, success) {
        (Some(create_duration_ms), Some(success)) if errors.is_empty() => Ok(MetricsEvent {
            sandbox_id,
            image,
            create_duration_ms,
            success,
        }),
        _ => Err(errors),
    }
}

/// `createDurationMs`: a required integer >= 0.
fn duration_field(obj: &Map<String, Value>, errors: &mut Vec<Value>) -> Option<u64> {
    let field = "createDurationMs";
    match obj.get(field) {
        None => errors.push(violation(Some(field), "missing", "Field required", None)),
        Some(v @ Value::Number(n)) => match (n.as_u64(), n.as_i64()) {
            (Some(ms), _) => return Some(ms),
            (None, Some(_)) => errors.push(violation(
                Some(field),
                "greater_than_equal",
                "Input should be greater than or equal to 0",
                Some(v),
            )),
            (None, None) => errors.push(violation(
                Some(field),
                "int_from_float",
                "Input should be a valid integer",
                Some(v),
            )),
        },
        Some(other) => errors.push(violation(
            Some(field),
            "int_type",
            "Input should be a valid integer",
            Some(other),
        )),
    }
    None
}

/// An optional string field (absent and `null` are both none).
fn optional_string(
    obj: &Map<String, Value>,
    field: &'static str,
    errors: &mut Vec<Value>,
) -> Option<String> {
    match obj.get(field) {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s.clone()),
        Some(other) => {
            errors.push(violation(
                Some(field),
                "string_type",
                "Input should be a valid string",
                Some(other),
            ));
            None
        }
    }
}

/// `POST /metrics/events`: counts and observes the event, logs it at debug
/// (inside the request's span, so with its request id); 204, or 422 for a
/// body that is not a `MetricsEvent`.
#[tracing::instrument(skip_all)]
pub(crate) async fn report_event(
    State(sdk): State<SdkMetrics>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let event = match parse_metrics_event(&body) {
        Ok(event) => event,
        Err(detail) => {
            tracing::debug!(?detail, "malformed SDK metrics event");
            return (
                StatusCode::UNPROCESSABLE_ENTITY,
                axum::Json(json!({ "detail": detail })),
            )
                .into_response();
        }
    };
    sdk.record(&event);
    let user_agent = headers
        .get(header::USER_AGENT)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    tracing::debug!(
        request_id = sandbolt_telemetry::request_id::current()
            .as_deref()
            .unwrap_or(""),
        event = SANDBOX_CREATE_EVENT,
        sandbox_id = event.sandbox_id.as_deref().unwrap_or(""),
        image = event.image.as_deref().unwrap_or(""),
        duration_ms = event.create_duration_ms,
        success = event.success,
        user_agent,
        "SDK metrics event"
    );
    StatusCode::NO_CONTENT.into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kinds(body: &str) -> Vec<(String, String)> {
        parse_metrics_event(body.as_bytes())
            .unwrap_err()
            .iter()
            .map(|v| (v["loc"].to_string(), v["type"].as_str().unwrap().to_owned()))
            .collect()
    }

    #[test]
    fn parses_what_the_sdk_sends() {
        let e = parse_metrics_event(
            br#"{"eventType":"sandbox.create","createDurationMs":1234,"success":true,"sandboxId":"s1","image":"busybox"}"#,
        )
        .unwrap();
        assert_eq!(
            e,
            MetricsEvent {
                sandbox_id: Some("s1".into()),
                image: Some("busybox".into()),
                create_duration_ms: 1234,
                success: true
            }
        );
        let e = parse_metrics_event(
            br#"{"eventType":"sandbox.create","createDurationMs":0,"success":false,"image":null}"#,
        )
        .unwrap();
        assert_eq!((e.sandbox_id, e.image, e.success), (None, None, false));
    }

    #[test]
    fn names_every_violation() {
        assert_eq!(kinds("{"), [(r#"["body"]"#.into(), "json_invalid".into())]);
        assert_eq!(
            kinds("[1]"),
            [(r#"["body"]"#.into(), "model_attributes_type".into())]
        );
        assert_eq!(
            kinds("{}"),
            [
                (r#"["body","eventType"]"#.into(), "missing".into()),
                (r#"["body","createDurationMs"]"#.into(), "missing".into()),
                (r#"["body","success"]"#.into(), "missing".into()),
            ]
        );
        assert_eq!(
            kinds(
                r#"{"eventType":"sandbox.delete","createDurationMs":-1,"success":"yes","sandboxId":7}"#
            ),
            [
                (r#"["body","eventType"]"#.into(), "literal_error".into()),
                (
                    r#"["body","createDurationMs"]"#.into(),
                    "greater_than_equal".into()
                ),
                (r#"["body","success"]"#.into(), "bool_type".into()),
                (r#"["body","sandboxId"]"#.into(), "string_type".into()),
            ]
        );
        assert_eq!(
            kinds(r#"{"eventType":"sandbox.create","createDurationMs":1.5,"success":true}"#),
            [(
                r#"["body","createDurationMs"]"#.into(),
                "int_from_float".into()
            )]
        );
    }
}
