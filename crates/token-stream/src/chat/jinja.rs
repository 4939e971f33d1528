//! The Jinja environment transformers renders chat templates in, rebuilt on minijinja.

use std::fmt::Write as _;

use minijinja::value::{Kwargs, Rest, ValueKind};
use minijinja::{Environment, Error, ErrorKind, State, Value};

use super::RenderOptions;
use crate::error::ChatError;

/// Name of the context variable carrying the pinned clock (not a name a template would use).
const NOW_VAR: &str = "__token_stream_now";

/// Marks an error raised by the template's `raise_exception`.
#[derive(Debug)]
struct Raised(String);

impl std::fmt::Display for Raised {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Raised {}

/// Python's `None` as transformers passes it for absent `tools`/`documents`: `is none`, false,
/// printed `None`, `null` in JSON, but not iterable and without a length (minijinja's own
/// `none` iterates as empty, where Python raises "'NoneType' object is not iterable").
#[derive(Debug)]
struct PyNone;

impl minijinja::value::Object for PyNone {
    fn repr(self: &std::sync::Arc<Self>) -> minijinja::value::ObjectRepr {
        minijinja::value::ObjectRepr::Plain
    }

    fn is_true(self: &std::sync::Arc<Self>) -> bool {
        false
    }

    fn render(self: &std::sync::Arc<Self>, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("None")
    }
}

fn py_none() -> Value {
    Value::from_object(PyNone)
}

/// `none`, or the [`PyNone`] stand-in.
fn is_none(v: &Value) -> bool {
    v.is_none() || v.downcast_object_ref::<PyNone>().is_some()
}

/// Jinja's `if value:` guard in its sequence filters: a falsy value is an empty list.
fn falsy_empty(v: Value) -> Value {
    if v.is_true() {
        v
    } else {
        Value::from(Vec::<Value>::new())
    }
}

/// A compiled template in its environment.
#[derive(Debug)]
pub(super) struct Compiled {
    env: Environment<'static>,
}

impl Compiled {
    pub(super) fn new(source: &str) -> Result<Self, ChatError> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_fuel(Some(super::ChatTemplate::FUEL));
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |msg: String| -> Result<Value, Error> {
            Err(Error::new(ErrorKind::InvalidOperation, msg.clone()).with_source(Raised(msg)))
        });
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson);
        // Jinja's `iterable` test: `none` is not iterable (minijinja iterates it as empty).
        env.add_test("iterable", |v: Value| {
            v.kind() != ValueKind::None && v.try_iter().is_ok()
        });
        env.add_test("none", |v: Value| is_none(&v));
        env.set_formatter(python_formatter);
        // Jinja's `map` is a generator: iterable once, no length, refused by `tojson`.
        // Jinja's map/select/reject/selectattr/rejectattr yield nothing for a falsy value
        // (`None` included) instead of failing.
        env.add_filter(
            "map",
            |state: &State<'_, '_>, value: Value, args: Rest<Value>| -> Result<Value, Error> {
                let items = minijinja::filters::map(state, falsy_empty(value), args)?;
                Ok(Value::make_one_shot_iterator(items.into_iter()))
            },
        );
        env.add_filter(
            "select",
            |state: &State<'_, '_>, value: Value, test: Option<String>, args: Rest<Value>| {
                minijinja::filters::select(state, falsy_empty(value), test.map(Into::into), args)
            },
        );
        env.add_filter(
            "reject",
            |state: &State<'_, '_>, value: Value, test: Option<String>, args: Rest<Value>| {
                minijinja::filters::reject(state, falsy_empty(value), test.map(Into::into), args)
            },
        );
        env.add_filter(
            "selectattr",
            |state: &State<'_, '_>,
             value: Value,
             attr: String,
             test: Option<String>,
             args: Rest<Value>| {
                minijinja::filters::selectattr(
                    state,
                    falsy_empty(value),
                    attr.into(),
                    test.map(Into::into),
                    args,
                )
            },
        );
        env.add_filter(
            "rejectattr",
            |state: &State<'_, '_>,
             value: Value,
             attr: String,
             test: Option<String>,
             args: Rest<Value>| {
                minijinja::filters::rejectattr(
                    state,
                    falsy_empty(value),
                    attr.into(),
                    test.map(Into::into),
                    args,
                )
            },
        );
        // Jinja's `string` filter is Python's `str()`.
        env.add_filter("string", |v: Value| -> Result<Value, Error> {
            match v.kind() {
                ValueKind::None | ValueKind::Bool | ValueKind::Seq | ValueKind::Map => {
                    let mut s = String::new();
                    py_repr(&v, &mut s)?;
                    Ok(Value::from(s))
                }
                ValueKind::String => Ok(v),
                ValueKind::Undefined => Ok(Value::from("")),
                _ => Ok(Value::from(v.to_string())),
            }
        });
        env.add_template_owned("chat", without_generation_tags(source))
            .map_err(convert)?;
        Ok(Self { env })
    }

    pub(super) fn render(
        &self,
        messages: Value,
        opts: &RenderOptions,
        bos: &str,
        eos: &str,
    ) -> Result<String, ChatError> {
        let tmpl = self.env.get_template("chat").map_err(convert)?;
        let mut ctx: Vec<(String, Value)> = vec![
            ("messages".into(), messages),
            ("tools".into(), opts.tools.clone().unwrap_or_else(py_none)),
            (
                "documents".into(),
                opts.documents.clone().unwrap_or_else(py_none),
            ),
            (
                "add_generation_prompt".into(),
                Value::from(opts.add_generation_prompt),
            ),
            ("bos_token".into(), Value::from(bos)),
            ("eos_token".into(), Value::from(eos)),
        ];
        for (k, v) in &opts.kwargs {
            ctx.retain(|(n, _)| n != k);
            ctx.push((k.clone(), v.clone()));
        }
        if let Some(t) = opts.now {
            ctx.push((NOW_VAR.into(), Value::from(t)));
        }
        tmpl.render(Value::from_iter(ctx)).map_err(convert)
    }
}

/// transformers' `{% generation %}...{% endgeneration %}` (its AssistantTracker extension)
/// renders its body unchanged: rewritten to `{% if true %}...{% endif %}`, keeping the tags'
/// whitespace control.
fn without_generation_tags(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(p) = rest.find("{%") {
        out.push_str(&rest[..p]);
        let tag = &rest[p..];
        let Some(end) = tag.find("%}") else {
            break;
        };
        let inner = &tag[2..end];
        let lead = inner.strip_prefix(['-', '+']);
        let body = lead.unwrap_or(inner);
        let trail = body.strip_suffix(['-', '+']);
        let word = trail.unwrap_or(body).trim();
        let replacement = match word {
            "generation" => Some("if true"),
            "endgeneration" => Some("endif"),
            _ => None,
        };
        match replacement {
            Some(r) => {
                out.push_str("{%");
                if lead.is_some() {
                    out.push_str(&inner[..1]);
                }
                out.push(' ');
                out.push_str(r);
                out.push(' ');
                if trail.is_some() {
                    out.push_str(&body[body.len() - 1..]);
                }
                out.push_str("%}");
            }
            None => out.push_str(&tag[..end + 2]),
        }
        rest = &tag[end + 2..];
    }
    out.push_str(rest);
    out
}

/// Prints values as Jinja2 does (Python's `str()`): `None`, `True`, `False`, floats as Python's
/// `repr`, and lists and dicts as Python's `repr` (`{'a': 1}`), not as JSON.
fn python_formatter(
    out: &mut minijinja::Output<'_>,
    state: &State<'_, '_>,
    value: &Value,
) -> Result<(), Error> {
    match value.kind() {
        ValueKind::None | ValueKind::Bool | ValueKind::Seq | ValueKind::Map => {
            let mut s = String::new();
            py_repr(value, &mut s)?;
            out.write_str(&s).map_err(Error::from)
        }
        ValueKind::Number if !value.is_integer() => match f64::try_from(value.clone()) {
            Ok(f) => out.write_str(&py_float(f)).map_err(Error::from),
            Err(_) => minijinja::escape_formatter(out, state, value),
        },
        _ => minijinja::escape_formatter(out, state, value),
    }
}

/// Python's `repr` of a JSON-like value.
fn py_repr(v: &Value, out: &mut String) -> Result<(), Error> {
    if is_none(v) {
        out.push_str("None");
        return Ok(());
    }
    match v.kind() {
        ValueKind::None | ValueKind::Undefined => out.push_str("None"),
        ValueKind::Bool => out.push_str(if v.is_true() { "True" } else { "False" }),
        ValueKind::Number => out.push_str(&number(v)),
        ValueKind::String => py_str_repr(v.as_str().unwrap_or_default(), out),
        ValueKind::Seq => {
            out.push('[');
            for (i, item) in v.try_iter()?.enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                py_repr(&item, out)?;
            }
            out.push(']');
        }
        ValueKind::Map => {
            out.push('{');
            for (i, k) in v.try_iter()?.enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                py_repr(&k, out)?;
                out.push_str(": ");
                py_repr(&v.get_item(&k)?, out)?;
            }
            out.push('}');
        }
        _ => out.push_str(&v.to_string()),
    }
    Ok(())
}

/// Python's `repr(str)`: single quotes unless the text has `'` and no `"`.
fn py_str_repr(s: &str, out: &mut String) {
    let q = if s.contains('\'') && !s.contains('"') {
        '"'
    } else {
        '\''
    };
    out.push(q);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == q => {
                out.push('\\');
                out.push(c);
            }
            c if (c as u32) < 0x20 || c as u32 == 0x7f => {
                let _ = write!(out, "\\x{:02x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push(q);
}

/// The typed error for a minijinja error.
pub(super) fn convert(err: Error) -> ChatError {
    let mut src: Option<&(dyn std::error::Error + 'static)> = Some(&err);
    while let Some(e) = src {
        if let Some(r) = e.downcast_ref::<Raised>() {
            return ChatError::Raised {
                message: r.0.clone(),
            };
        }
        src = e.source();
    }
    if err.kind() == ErrorKind::OutOfFuel {
        return ChatError::Exhausted;
    }
    ChatError::Template(err)
}

// ---------------------------------------------------------------------------------------------
// strftime_now

fn strftime_now(state: &State<'_, '_>, format: String) -> Result<Value, Error> {
    let now = match state.lookup(NOW_VAR).and_then(|v| i64::try_from(v).ok()) {
        Some(t) => t,
        None => std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX))
            .unwrap_or(0),
    };
    strftime(&format, now).map(Value::from)
}

/// Days since 1970-01-01 to (year, month 1..=12, day 1..=31) (Howard Hinnant's algorithm).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (if m <= 2 { y + 1 } else { y }, m, d)
}

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];
const DAYS: [&str; 7] = [
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
    "Sunday",
];

/// C `strftime` in the C locale for a UTC Unix time (the directives Python documents).
pub(super) fn strftime(format: &str, unix: i64) -> Result<String, Error> {
    let days = unix.div_euclid(86_400);
    let secs = unix.rem_euclid(86_400);
    let (y, m, d) = civil_from_days(days);
    let (hh, mm, ss) = (secs / 3600, secs / 60 % 60, secs % 60);
    let wd = (days + 3).rem_euclid(7) as usize; // 0 = Monday (1970-01-01 was a Thursday)
    let jan1 = days_from_civil(y, 1, 1);
    let yday = days - jan1; // 0-based
    let mut out = String::with_capacity(format.len() + 16);
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let Some(dir) = chars.next() else {
            out.push('%');
            break;
        };
        let month = MONTHS[(m - 1) as usize];
        let day = DAYS[wd];
        let h12 = if hh % 12 == 0 { 12 } else { hh % 12 };
        match dir {
            'd' => write!(out, "{d:02}"),
            'e' => write!(out, "{d:>2}"),
            'm' => write!(out, "{m:02}"),
            'Y' => write!(out, "{y}"),
            'y' => write!(out, "{:02}", y.rem_euclid(100)),
            'b' | 'h' => write!(out, "{}", &month[..3]),
            'B' => write!(out, "{month}"),
            'a' => write!(out, "{}", &day[..3]),
            'A' => write!(out, "{day}"),
            'w' => write!(out, "{}", (wd + 1) % 7),
            'u' => write!(out, "{}", wd + 1),
            'H' => write!(out, "{hh:02}"),
            'I' => write!(out, "{h12:02}"),
            'M' => write!(out, "{mm:02}"),
            'S' => write!(out, "{ss:02}"),
            'p' => write!(out, "{}", if hh < 12 { "AM" } else { "PM" }),
            'j' => write!(out, "{:03}", yday + 1),
            'F' => write!(out, "{y}-{m:02}-{d:02}"),
            'T' => write!(out, "{hh:02}:{mm:02}:{ss:02}"),
            'D' => write!(out, "{m:02}/{d:02}/{:02}", y.rem_euclid(100)),
            'R' => write!(out, "{hh:02}:{mm:02}"),
            'c' => write!(
                out,
                "{} {} {d:>2} {hh:02}:{mm:02}:{ss:02} {y}",
                &day[..3],
                &month[..3]
            ),
            'x' => write!(out, "{m:02}/{d:02}/{:02}", y.rem_euclid(100)),
            'X' => write!(out, "{hh:02}:{mm:02}:{ss:02}"),
            'Z' => write!(out, "UTC"),
            'z' => write!(out, "+0000"),
            'f' => write!(out, "000000"),
            'n' => writeln!(out),
            't' => write!(out, "\t"),
            '%' => write!(out, "%"),
            other => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    format!("strftime_now: unsupported directive %{other}"),
                ));
            }
        }
        .map_err(|_| Error::new(ErrorKind::InvalidOperation, "strftime_now: format failed"))?;
    }
    Ok(out)
}

fn days_from_civil(y: i64, m: u32, d: u32) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let m = i64::from(m);
    let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + i64::from(d) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

// ---------------------------------------------------------------------------------------------
// tojson, as transformers defines it: json.dumps(x, ensure_ascii=False, indent=None,
// separators=None, sort_keys=False).

struct JsonStyle {
    ensure_ascii: bool,
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    sort_keys: bool,
}

fn tojson(value: Value, args: Rest<Value>, kwargs: Kwargs) -> Result<Value, Error> {
    // Positional order of transformers' tojson(x, ensure_ascii, indent, separators, sort_keys).
    let pos = |i: usize| args.0.get(i).cloned();
    let ensure_ascii = kwargs
        .get::<Option<Value>>("ensure_ascii")?
        .or_else(|| pos(0))
        .is_some_and(|v| v.is_true());
    let indent_v = kwargs.get::<Option<Value>>("indent")?.or_else(|| pos(1));
    let seps_v = kwargs
        .get::<Option<Value>>("separators")?
        .or_else(|| pos(2));
    let sort_keys = kwargs
        .get::<Option<Value>>("sort_keys")?
        .or_else(|| pos(3))
        .is_some_and(|v| v.is_true());
    kwargs.assert_all_used()?;
    let indent = match indent_v {
        None => None,
        Some(v) if v.is_none() || v.is_undefined() => None,
        Some(v) => match v.as_str() {
            Some(s) => Some(s.to_owned()),
            None => {
                let n = i64::try_from(v.clone()).map_err(|_| {
                    Error::new(ErrorKind::InvalidOperation, "tojson: indent must be an int")
                })?;
                Some(" ".repeat(usize::try_from(n.max(0)).unwrap_or(0)))
            }
        },
    };
    let (item_sep, key_sep) = match seps_v {
        Some(v) if !v.is_none() && !v.is_undefined() => {
            let a = v.get_item_by_index(0)?;
            let b = v.get_item_by_index(1)?;
            match (a.as_str(), b.as_str()) {
                (Some(a), Some(b)) => (a.to_owned(), b.to_owned()),
                _ => {
                    return Err(Error::new(
                        ErrorKind::InvalidOperation,
                        "tojson: separators must be two strings",
                    ));
                }
            }
        }
        _ => (
            if indent.is_some() { "," } else { ", " }.to_owned(),
            ": ".to_owned(),
        ),
    };
    let style = JsonStyle {
        ensure_ascii,
        indent,
        item_sep,
        key_sep,
        sort_keys,
    };
    let mut out = String::new();
    dump(&value, &style, 0, &mut out)?;
    Ok(Value::from(out))
}

fn not_serializable(v: &Value) -> Error {
    let kind = match v.kind() {
        ValueKind::Iterable => "generator".to_owned(),
        k => k.to_string(),
    };
    Error::new(
        ErrorKind::InvalidOperation,
        format!("Object of type {kind} is not JSON serializable"),
    )
}

fn newline(style: &JsonStyle, level: usize, out: &mut String) {
    if let Some(ind) = &style.indent {
        out.push('\n');
        for _ in 0..level {
            out.push_str(ind);
        }
    }
}

fn dump(v: &Value, style: &JsonStyle, level: usize, out: &mut String) -> Result<(), Error> {
    if is_none(v) {
        out.push_str("null");
        return Ok(());
    }
    match v.kind() {
        ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number => out.push_str(&number(v)),
        ValueKind::String => string(v.as_str().unwrap_or_default(), style.ensure_ascii, out),
        ValueKind::Seq => {
            let items: Vec<Value> = v.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(&style.item_sep);
                }
                newline(style, level + 1, out);
                dump(item, style, level + 1, out)?;
            }
            newline(style, level, out);
            out.push(']');
        }
        ValueKind::Map => {
            let mut keys: Vec<(String, Value)> = Vec::new();
            for k in v.try_iter()? {
                let ks = match k.kind() {
                    ValueKind::String => k.as_str().unwrap_or_default().to_owned(),
                    ValueKind::Number => number(&k),
                    ValueKind::Bool => if k.is_true() { "true" } else { "false" }.to_owned(),
                    ValueKind::None => "null".to_owned(),
                    _ => {
                        return Err(Error::new(
                            ErrorKind::InvalidOperation,
                            format!(
                                "keys must be str, int, float, bool or None, not {}",
                                k.kind()
                            ),
                        ));
                    }
                };
                let val = v.get_item(&k)?;
                keys.push((ks, val));
            }
            if keys.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            if style.sort_keys {
                keys.sort_by(|a, b| a.0.cmp(&b.0));
            }
            out.push('{');
            for (i, (k, val)) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(&style.item_sep);
                }
                newline(style, level + 1, out);
                string(k, style.ensure_ascii, out);
                out.push_str(&style.key_sep);
                dump(val, style, level + 1, out)?;
            }
            newline(style, level, out);
            out.push('}');
        }
        _ => return Err(not_serializable(v)),
    }
    Ok(())
}

/// A number as Python's `json.dumps` writes it (`float.__repr__` for floats).
fn number(v: &Value) -> String {
    if v.is_integer() {
        return v.to_string();
    }
    match f64::try_from(v.clone()) {
        Ok(f) => py_float(f),
        Err(_) => v.to_string(),
    }
}

/// Python's `repr(float)`: shortest round-trip digits, exponent form below 1e-4 and from 1e16.
fn py_float(f: f64) -> String {
    if f.is_nan() {
        return "NaN".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { "Infinity" } else { "-Infinity" }.into();
    }
    if f == 0.0 {
        return if f.is_sign_negative() { "-0.0" } else { "0.0" }.into();
    }
    let e = format!("{f:e}"); // e.g. "-1.5e-5"
    let (mant, exp) = e.split_once('e').unwrap_or((&e, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let neg = mant.starts_with('-');
    let digits: String = mant.chars().filter(char::is_ascii_digit).collect();
    let mut s = String::new();
    if neg {
        s.push('-');
    }
    if (-4..16).contains(&exp) {
        if exp < 0 {
            s.push_str("0.");
            for _ in 0..(-exp - 1) {
                s.push('0');
            }
            s.push_str(&digits);
        } else {
            let point = usize::try_from(exp).unwrap_or(0) + 1;
            if digits.len() <= point {
                s.push_str(&digits);
                for _ in digits.len()..point {
                    s.push('0');
                }
                s.push_str(".0");
            } else {
                s.push_str(&digits[..point]);
                s.push('.');
                s.push_str(&digits[point..]);
            }
        }
    } else {
        s.push_str(&digits[..1]);
        if digits.len() > 1 {
            s.push('.');
            s.push_str(&digits[1..]);
        }
        let _ = write!(s, "e{}{:02}", if exp < 0 { '-' } else { '+' }, exp.abs());
    }
    s
}

/// A JSON string as Python's `json.dumps` writes it.
fn string(s: &str, ensure_ascii: bool, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            // The encode markers (never in request text) stay markers under `ensure_ascii`.
            super::mark::OPEN | super::mark::CLOSE => out.push(c),
            c if (c as u32) < 0x20 || (ensure_ascii && (c as u32) > 0x7e) => {
                let mut buf = [0u16; 2];
                for u in c.encode_utf16(&mut buf) {
                    let _ = write!(out, "\\u{u:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn floats_as_python_repr() {
        assert_eq!(py_float(1.0), "1.0");
        assert_eq!(py_float(0.1), "0.1");
        assert_eq!(py_float(1e16), "1e+16");
        assert_eq!(py_float(123_456_789_012_345.6), "123456789012345.6");
        assert_eq!(py_float(1.5e-5), "1.5e-05");
        assert_eq!(py_float(0.0001), "0.0001");
        assert_eq!(py_float(-2.5), "-2.5");
    }

    #[test]
    fn strftime_known_instants() {
        // 2026-01-15 12:34:56 UTC, a Thursday.
        let t = 1_768_480_496;
        assert_eq!(strftime("%d %b %Y", t).unwrap(), "15 Jan 2026");
        assert_eq!(
            strftime("%A %B %d %H:%M:%S %j %p %I", t).unwrap(),
            "Thursday January 15 12:34:56 015 PM 12"
        );
        assert_eq!(strftime("%Y-%m-%d", 0).unwrap(), "1970-01-01");
        assert_eq!(
            strftime("%Y-%m-%d %a", 951_782_400).unwrap(),
            "2000-02-29 Tue"
        );
    }
}
