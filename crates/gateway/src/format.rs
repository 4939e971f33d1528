//! Structured output requests of both APIs, as an [`OutputFormat`]: OpenAI `response_format`
//! (`text`, `json_object`, `json_schema`) and Anthropic `output_config.format` (and the beta's
//! top-level `output_format`) of type `json_schema`. Schemas over the size and depth limits
//! (`schema.rs`) are refused here; whether one compiles is the engine's verdict (a 400 naming
//! the field comes back from the service).

use serde_json::{Map, Value, json};

use super::error::ApiError;
use super::fields::check_keys;
use super::schema::check_schema_limits;
use super::validate::{get, wrong_type};
use zerolayer_api::OutputFormat;

/// A JSON Schema at `path`: an object within the schema limits (a boolean schema `true` allows
/// any JSON).
fn schema(v: Option<&Value>, path: &str) -> Result<Value, ApiError> {
    match v {
        None => Err(ApiError::invalid(format!("{path}: Field required"))),
        Some(s @ Value::Object(_)) => {
            check_schema_limits(s, path)?;
            Ok(s.clone())
        }
        Some(Value::Bool(true)) => Ok(json!({})),
        Some(other) => Err(wrong_type(path, "JSON Schema object", other)),
    }
}

fn object<'a>(v: &'a Value, path: &str) -> Result<&'a Map<String, Value>, ApiError> {
    v.as_object().ok_or_else(|| wrong_type(path, "object", v))
}

/// A requested output format and the field of its schema (named when the schema is refused).
pub(crate) type Requested = (OutputFormat, &'static str);

/// OpenAI `response_format`: `None` for `text`.
///
/// ```ignore
/// response_format(&obj) // {"type": "json_object"} -> Some(JsonSchema({"type": "object"}))
/// ```
pub(crate) fn response_format(obj: &Map<String, Value>) -> Result<Option<Requested>, ApiError> {
    let Some(v) = get(obj, "response_format") else {
        return Ok(None);
    };
    let rf = object(v, "response_format")?;
    match rf.get("type").and_then(Value::as_str) {
        Some("text") => {
            check_keys(rf, &["type"], "response_format")?;
            Ok(None)
        }
        Some("json_object") => {
            check_keys(rf, &["type"], "response_format")?;
            Ok(Some((
                OutputFormat::JsonSchema(json!({"type": "object"})),
                "response_format",
            )))
        }
        Some("json_schema") => {
            check_keys(rf, &["type", "json_schema"], "response_format")?;
            let path = "response_format.json_schema";
            let schema_path = "response_format.json_schema.schema";
            let Some(js) = get(rf, "json_schema") else {
                return Err(ApiError::invalid(format!("{path}: Field required")));
            };
            let js = object(js, path)?;
            check_keys(js, &["name", "description", "schema", "strict"], path)?;
            match get(js, "name") {
                Some(Value::String(_)) => {}
                None => return Err(ApiError::invalid(format!("{path}.name: Field required"))),
                Some(other) => return Err(wrong_type(&format!("{path}.name"), "string", other)),
            }
            // OpenAI: without a schema the reply is any JSON.
            let s = match get(js, "schema") {
                None => json!({}),
                s => schema(s, schema_path)?,
            };
            Ok(Some((OutputFormat::JsonSchema(s), schema_path)))
        }
        _ => Err(ApiError::invalid(
            "response_format.type: Input should be 'text', 'json_object' or 'json_schema'",
        )),
    }
}

/// Anthropic `output_config` (`{"format": {"type": "json_schema", "schema": ...}}`) or the
/// beta's top-level `output_format` (the same format object).
pub(crate) fn output_config(obj: &Map<String, Value>) -> Result<Option<Requested>, ApiError> {
    let (format, path, schema_path) = match (get(obj, "output_config"), get(obj, "output_format")) {
        (Some(_), Some(_)) => {
            return Err(ApiError::invalid(
                "output_format: give either `output_config.format` or `output_format`, not both",
            ));
        }
        (Some(cfg), None) => {
            let cfg = object(cfg, "output_config")?;
            // `effort` tunes thinking, which this server does not do.
            check_keys(cfg, &["format"], "output_config")?;
            match get(cfg, "format") {
                None => return Ok(None),
                Some(f) => (f, "output_config.format", "output_config.format.schema"),
            }
        }
        (None, Some(f)) => (f, "output_format", "output_format.schema"),
        (None, None) => return Ok(None),
    };
    let f = object(format, path)?;
    match f.get("type").and_then(Value::as_str) {
        Some("json_schema") => {
            check_keys(f, &["type", "schema"], path)?;
            let s = schema(get(f, "schema"), schema_path)?;
            Ok(Some((OutputFormat::JsonSchema(s), schema_path)))
        }
        _ => Err(ApiError::invalid(format!(
            "{path}.type: Input should be 'json_schema'"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rf(v: Value) -> Result<Option<OutputFormat>, String> {
        response_format(json!({ "response_format": v }).as_object().unwrap())
            .map(|f| f.map(|(format, _)| format))
            .map_err(|e| e.message)
    }

    fn oc(v: Value) -> Result<Option<OutputFormat>, String> {
        output_config(v.as_object().unwrap())
            .map(|f| f.map(|(format, _)| format))
            .map_err(|e| e.message)
    }

    #[test]
    fn openai_response_formats() {
        assert_eq!(rf(json!({"type": "text"})), Ok(None));
        assert_eq!(
            rf(json!({"type": "json_object"})),
            Ok(Some(OutputFormat::JsonSchema(json!({"type": "object"}))))
        );
        let s = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
        assert_eq!(
            rf(json!({"type": "json_schema",
                "json_schema": {"name": "x", "schema": s, "strict": true}})),
            Ok(Some(OutputFormat::JsonSchema(s.clone())))
        );
        assert_eq!(
            rf(json!({"type": "json_schema", "json_schema": {"name": "x"}})),
            Ok(Some(OutputFormat::JsonSchema(json!({}))))
        );
        let e = rf(json!({"type": "json_schema", "json_schema": {"schema": s}})).unwrap_err();
        assert_eq!(e, "response_format.json_schema.name: Field required");
        let e = rf(json!({"type": "json_schema", "json_schema": {"name": "x", "schema": 3}}))
            .unwrap_err();
        assert!(
            e.starts_with("response_format.json_schema.schema: Input should be"),
            "{e}"
        );
        let e = rf(json!({"type": "grammar"})).unwrap_err();
        assert!(e.starts_with("response_format.type:"), "{e}");
        let e = rf(json!({"type": "json_object", "schema": {}})).unwrap_err();
        assert!(e.starts_with("response_format.schema:"), "{e}");
    }

    #[test]
    fn anthropic_output_config_and_beta_output_format() {
        let s = json!({"type": "object", "required": ["a"]});
        let want = Ok(Some(OutputFormat::JsonSchema(s.clone())));
        let fmt = json!({"type": "json_schema", "schema": s});
        assert_eq!(oc(json!({"output_config": {"format": fmt}})), want);
        assert_eq!(oc(json!({"output_format": fmt})), want);
        assert_eq!(oc(json!({"output_config": {}})), Ok(None));
        assert_eq!(oc(json!({})), Ok(None));
        let e = oc(json!({"output_config": {"effort": "high"}})).unwrap_err();
        assert!(e.starts_with("output_config.effort:"), "{e}");
        let e = oc(json!({"output_config": {"format": {"type": "json_schema"}}})).unwrap_err();
        assert_eq!(e, "output_config.format.schema: Field required");
        let e = oc(json!({"output_format": {"type": "text"}})).unwrap_err();
        assert!(e.starts_with("output_format.type:"), "{e}");
        let e = oc(json!({"output_format": fmt, "output_config": {"format": fmt}})).unwrap_err();
        assert!(e.starts_with("output_format:"), "{e}");
    }
}
