//! Limits on the JSON Schemas a request carries (`output_config.format.schema`,
//! `response_format.json_schema.schema`, each tool's `input_schema` / `function.parameters`),
//! checked while the request is validated, before any of them reaches the grammar compiler.
//!
//! The compiler's own work grows with a schema's size, and its limits are met only when the
//! first token is constrained; these bounds keep what reaches it small, and a schema over them
//! gets a 400 naming its field. What they do not catch (a schema that can never be satisfied,
//! such as `{"$ref": "#"}`) the service finds when it compiles the schema, before generating:
//! also a 400 naming the field.

use serde_json::Value;

use super::error::ApiError;

/// Deepest nesting of JSON values in one schema (the schema itself is level 1; each object or
/// array adds a level, so a property's schema is two levels below its object's schema).
pub(crate) const MAX_SCHEMA_DEPTH: usize = 64;

/// Most JSON values (objects, arrays, strings, numbers, ... each counted once) in one schema.
pub(crate) const MAX_SCHEMA_VALUES: usize = 8192;

/// Why a schema was refused before compilation.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum SchemaLimitError {
    /// The schema nests deeper than [`MAX_SCHEMA_DEPTH`].
    #[error("{path}: the JSON Schema nests deeper than {MAX_SCHEMA_DEPTH} levels")]
    TooDeep {
        /// The schema's field in the request.
        path: String,
    },
    /// The schema holds more than [`MAX_SCHEMA_VALUES`] JSON values.
    #[error(
        "{path}: the JSON Schema is too large (more than {MAX_SCHEMA_VALUES} JSON values; \
         e.g. an `anyOf` or `enum` with thousands of entries)"
    )]
    TooLarge {
        /// The schema's field in the request.
        path: String,
    },
}

impl From<SchemaLimitError> for ApiError {
    fn from(e: SchemaLimitError) -> Self {
        Self::invalid(e.to_string())
    }
}

/// Checks `schema` (the value at `path`) against [`MAX_SCHEMA_DEPTH`] and
/// [`MAX_SCHEMA_VALUES`], without recursion and stopping at the first excess.
pub(crate) fn check_schema_limits(schema: &Value, path: &str) -> Result<(), SchemaLimitError> {
    let mut seen = 0usize;
    let mut pending = vec![(schema, 1usize)];
    while let Some((value, depth)) = pending.pop() {
        seen += 1;
        if depth > MAX_SCHEMA_DEPTH {
            return Err(SchemaLimitError::TooDeep { path: path.into() });
        }
        match value {
            Value::Array(items) => pending.extend(items.iter().map(|v| (v, depth + 1))),
            Value::Object(map) => pending.extend(map.values().map(|v| (v, depth + 1))),
            _ => {}
        }
        if seen + pending.len() > MAX_SCHEMA_VALUES {
            return Err(SchemaLimitError::TooLarge { path: path.into() });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn nested(levels: usize) -> Value {
        (1..levels).fold(
            json!({"type": "string"}),
            |inner, _| json!({"items": inner}),
        )
    }

    #[test]
    fn depth_limit_counts_json_levels() {
        // `{"type": "string"}` is two levels (the object and its string); each wrapper adds one.
        assert_eq!(
            check_schema_limits(&nested(MAX_SCHEMA_DEPTH - 1), "s"),
            Ok(())
        );
        assert_eq!(
            check_schema_limits(&nested(MAX_SCHEMA_DEPTH), "s"),
            Err(SchemaLimitError::TooDeep { path: "s".into() })
        );
    }

    #[test]
    fn size_limit_counts_every_value() {
        let alternatives = |n: usize| json!({"anyOf": vec![json!(true); n]});
        // The object, its array and the alternatives.
        assert_eq!(
            check_schema_limits(&alternatives(MAX_SCHEMA_VALUES - 2), "s"),
            Ok(())
        );
        let e = check_schema_limits(&alternatives(MAX_SCHEMA_VALUES - 1), "tools.0.input_schema")
            .unwrap_err();
        assert_eq!(
            e,
            SchemaLimitError::TooLarge {
                path: "tools.0.input_schema".into()
            }
        );
        assert!(e.to_string().starts_with("tools.0.input_schema: "), "{e}");
    }

    #[test]
    fn small_recursive_schemas_pass_the_limits() {
        // Recursion is the compiler's to judge: the limits are about size.
        assert_eq!(check_schema_limits(&json!({"$ref": "#"}), "s"), Ok(()));
    }
}
