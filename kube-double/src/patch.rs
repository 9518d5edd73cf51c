//! PATCH bodies: JSON Patch (RFC 6902), JSON Merge Patch (RFC 7386), and
//! strategic merge patch approximated as a merge patch.

use serde_json::Value;

use crate::kinds::Kind;
use crate::status::ApiError;

const JSON_PATCH: &str = "application/json-patch+json";
const MERGE_PATCH: &str = "application/merge-patch+json";
const STRATEGIC_PATCH: &str = "application/strategic-merge-patch+json";

/// Applies `body` of media type `content_type` to `current`.
pub(crate) fn apply(
    kind: &Kind,
    name: &str,
    content_type: &str,
    body: &[u8],
    current: &Value,
) -> Result<Value, ApiError> {
    let media = content_type
        .split(';')
        .next()
        .unwrap_or_default()
        .trim()
        .to_ascii_lowercase();
    // Custom resources have no Go struct tags to drive a strategic merge,
    // so the server does not offer it for them.
    let accepted = if kind.custom {
        format!("{JSON_PATCH}, {MERGE_PATCH}")
    } else {
        format!("{JSON_PATCH}, {MERGE_PATCH}, {STRATEGIC_PATCH}")
    };
    let mut doc = current.clone();
    match media.as_str() {
        JSON_PATCH => {
            let ops: json_patch::Patch = serde_json::from_slice(body)
                .map_err(|e| ApiError::bad_request(format!("error decoding patch: {e}")))?;
            // The server reports a failed `test` or a missing path as an
            // invalid `patch` field (422), not as a bad request.
            json_patch::patch(&mut doc, &ops.0)
                .map_err(|e| ApiError::invalid(kind, name, "patch", &e.to_string()))?;
        }
        MERGE_PATCH => merge(&mut doc, body)?,
        STRATEGIC_PATCH if !kind.custom => merge(&mut doc, body)?,
        _ => return Err(ApiError::unsupported_media_type(&media, &accepted)),
    }
    Ok(doc)
}

fn merge(doc: &mut Value, body: &[u8]) -> Result<(), ApiError> {
    let patch: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_request(format!("error decoding patch: {e}")))?;
    if !patch.is_object() {
        return Err(ApiError::bad_request(
            "error decoding patch: a merge patch must be a JSON object",
        ));
    }
    json_patch::merge(doc, &patch);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn patch_kinds() {
        let kinds = crate::kinds::builtin();
        let (pod, sandbox) = (&kinds[0], &kinds[2]);
        let cur =
            json!({"metadata": {"name": "a", "labels": {"x": "1", "y": "2"}}, "spec": {"n": 1}});
        let merged = apply(
            pod,
            "a",
            MERGE_PATCH,
            br#"{"metadata":{"labels":{"x":null}},"spec":{"n":2}}"#,
            &cur,
        )
        .unwrap();
        assert_eq!(merged["metadata"]["labels"], json!({"y": "2"}));
        assert_eq!(merged["spec"]["n"], 2);
        let jp = apply(pod, "a", JSON_PATCH, br#"[{"op":"test","path":"/spec/n","value":1},{"op":"replace","path":"/spec/n","value":3}]"#, &cur).unwrap();
        assert_eq!(jp["spec"]["n"], 3);
        let failed = apply(
            pod,
            "a",
            JSON_PATCH,
            br#"[{"op":"test","path":"/spec/n","value":9}]"#,
            &cur,
        )
        .unwrap_err();
        assert_eq!(failed.code, 422);
        assert_eq!(
            apply(pod, "a", JSON_PATCH, b"{", &cur).unwrap_err().code,
            400
        );
        assert!(apply(pod, "a", STRATEGIC_PATCH, b"{}", &cur).is_ok());
        assert_eq!(
            apply(sandbox, "a", STRATEGIC_PATCH, b"{}", &cur)
                .unwrap_err()
                .code,
            415
        );
        assert_eq!(
            apply(pod, "a", "application/apply-patch+yaml", b"{}", &cur)
                .unwrap_err()
                .code,
            415
        );
    }
}
