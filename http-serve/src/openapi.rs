//! A small builder of OpenAPI 3.1 documents whose schemas come from the
//! code's own types: every request and response body is a
//! [`JsonSchema`] derived from the type's serde attributes (schemars, JSON
//! Schema 2020-12, the dialect of OpenAPI 3.1), so the document cannot
//! drift from what the handlers parse and write.
//!
//! Request bodies are described as they are *parsed* and response bodies as
//! they are *written* (schemars' deserialize and serialize contracts): a
//! member with a serde default is optional in a request, and present in a
//! response. A type whose two schemas are the same appears once under
//! `components/schemas`; one whose schemas differ appears twice, its
//! request form named with the suffix `Request`.
//!
//! Both servers write an absent optional member by leaving it out and
//! refuse `null` for one, so `null` is dropped from the schema of every
//! member that is not required.
//!
//! Nothing here knows either API: each daemon lists its operations.

use std::collections::BTreeMap;

use schemars::generate::{Contract, SchemaSettings};
use schemars::{JsonSchema, SchemaGenerator};
use serde_json::{Map, Value, json};

const SCHEMAS: &str = "#/components/schemas/";
/// Where request-side schemas live until [`ApiDocument::finish`] names them.
const REQUEST_SCHEMAS: &str = "#/components/requestSchemas/";

/// One operation of an API (a method on a path).
#[derive(Debug, Clone)]
pub struct Operation {
    operation_id: String,
    summary: String,
    description: Option<String>,
    tags: Vec<String>,
    security: Option<Vec<Vec<String>>>,
    parameters: Vec<Value>,
    request_body: Option<Value>,
    responses: BTreeMap<String, Value>,
}

impl Operation {
    pub fn new(operation_id: &str, summary: &str) -> Self {
        Self {
            operation_id: operation_id.to_owned(),
            summary: summary.to_owned(),
            description: None,
            tags: Vec::new(),
            security: None,
            parameters: Vec::new(),
            request_body: None,
            responses: BTreeMap::new(),
        }
    }

    pub fn description(mut self, description: &str) -> Self {
        self.description = Some(description.to_owned());
        self
    }

    pub fn tag(mut self, tag: &str) -> Self {
        self.tags.push(tag.to_owned());
        self
    }

    /// Callers must satisfy one of `alternatives`; each alternative names
    /// security schemes that must all be satisfied. An empty list: no
    /// credentials needed.
    pub fn security(mut self, alternatives: &[&[&str]]) -> Self {
        self.security = Some(
            alternatives
                .iter()
                .map(|schemes| schemes.iter().map(|&scheme| scheme.to_owned()).collect())
                .collect(),
        );
        self
    }

    /// A path parameter (`{name}` in the path).
    pub fn path_parameter(mut self, name: &str, description: &str, schema: Value) -> Self {
        self.parameters.push(json!({
            "name": name,
            "in": "path",
            "required": true,
            "description": description,
            "schema": schema,
        }));
        self
    }

    /// An optional query parameter.
    pub fn query_parameter(mut self, name: &str, description: &str, schema: Value) -> Self {
        self.parameters.push(json!({
            "name": name,
            "in": "query",
            "required": false,
            "description": description,
            "schema": schema,
        }));
        self
    }

    /// A JSON request body of `schema` (from [`ApiDocument::request`]);
    /// `required: false` when an empty body is accepted too.
    pub fn json_body(mut self, schema: Value, required: bool) -> Self {
        self.request_body = Some(json!({
            "required": required,
            "content": {"application/json": {"schema": schema}},
        }));
        self
    }

    /// A response with `status`.
    pub fn response(mut self, status: u16, response: Response) -> Self {
        self.responses.insert(status.to_string(), response.0);
        self
    }

    fn into_value(self) -> Value {
        let mut operation = Map::new();
        operation.insert("operationId".into(), self.operation_id.into());
        operation.insert("summary".into(), self.summary.into());
        if let Some(description) = self.description {
            operation.insert("description".into(), description.into());
        }
        if !self.tags.is_empty() {
            operation.insert("tags".into(), self.tags.into());
        }
        if let Some(alternatives) = self.security {
            let requirements: Vec<Value> = alternatives
                .into_iter()
                .map(|schemes| {
                    Value::Object(
                        schemes
                            .into_iter()
                            .map(|scheme| (scheme, Value::Array(Vec::new())))
                            .collect(),
                    )
                })
                .collect();
            operation.insert("security".into(), requirements.into());
        }
        if !self.parameters.is_empty() {
            operation.insert("parameters".into(), self.parameters.into());
        }
        if let Some(body) = self.request_body {
            operation.insert("requestBody".into(), body);
        }
        operation.insert(
            "responses".into(),
            Value::Object(self.responses.into_iter().collect()),
        );
        Value::Object(operation)
    }
}

/// One response: a description, optionally a body and headers.
#[derive(Debug, Clone)]
pub struct Response(Value);

impl Response {
    pub fn new(description: &str) -> Self {
        Self(json!({"description": description}))
    }

    /// A JSON body of `schema` (from [`ApiDocument::response`]).
    pub fn json(self, schema: Value) -> Self {
        self.content("application/json", schema)
    }

    /// A body of `media_type`.
    pub fn content(mut self, media_type: &str, schema: Value) -> Self {
        self.0["content"][media_type] = json!({"schema": schema});
        self
    }

    /// A response header.
    pub fn header(mut self, name: &str, description: &str, required: bool, schema: Value) -> Self {
        self.0["headers"][name] = json!({
            "description": description,
            "required": required,
            "schema": schema,
        });
        self
    }
}

/// An OpenAPI 3.1 document under construction.
#[derive(Debug)]
pub struct ApiDocument {
    info: Value,
    requests: SchemaGenerator,
    responses: SchemaGenerator,
    paths: BTreeMap<String, Map<String, Value>>,
    security_schemes: Map<String, Value>,
    extra_schemas: Map<String, Value>,
}

impl ApiDocument {
    pub fn new(title: &str, version: &str, description: &str) -> Self {
        let generator = |contract: Contract, path: &str| {
            SchemaSettings::draft2020_12()
                .with(|settings| {
                    settings.contract = contract;
                    settings.definitions_path = path.to_owned().into();
                    settings.meta_schema = None;
                })
                .into_generator()
        };
        Self {
            info: json!({"title": title, "version": version, "description": description}),
            requests: generator(Contract::Deserialize, "/components/requestSchemas"),
            responses: generator(Contract::Serialize, "/components/schemas"),
            paths: BTreeMap::new(),
            security_schemes: Map::new(),
            extra_schemas: Map::new(),
        }
    }

    /// The schema of `T` as a request body (as the server parses it).
    pub fn request<T: JsonSchema>(&mut self) -> Value {
        self.requests.subschema_for::<T>().to_value()
    }

    /// The schema of `T` as a response body (as the server writes it).
    pub fn response<T: JsonSchema>(&mut self) -> Value {
        self.responses.subschema_for::<T>().to_value()
    }

    /// A schema written by hand under `components/schemas/{name}` (for a
    /// body no type describes, such as plain text); returns its reference.
    pub fn named_schema(&mut self, name: &str, schema: Value) -> Value {
        self.extra_schemas.insert(name.to_owned(), schema);
        json!({"$ref": format!("{SCHEMAS}{name}")})
    }

    pub fn security_scheme(&mut self, name: &str, scheme: Value) {
        self.security_schemes.insert(name.to_owned(), scheme);
    }

    pub fn operation(&mut self, method: &str, path: &str, operation: Operation) {
        self.paths
            .entry(path.to_owned())
            .or_default()
            .insert(method.to_ascii_lowercase(), operation.into_value());
    }

    /// The document as JSON.
    pub fn finish(mut self) -> Value {
        let request_defs = self.requests.take_definitions(true);
        let mut schemas = self.responses.take_definitions(true);
        let names = request_names(&request_defs, &schemas);
        for (name, mut schema) in request_defs {
            rename_request_refs(&mut schema, &names);
            let final_name = &names[&name];
            if !schemas.contains_key(final_name) {
                schemas.insert(final_name.clone(), schema);
            }
        }
        schemas.extend(std::mem::take(&mut self.extra_schemas));
        let schemas: BTreeMap<String, Value> = schemas.into_iter().collect();
        let mut paths = Map::new();
        for (path, operations) in self.paths {
            paths.insert(path, Value::Object(operations));
        }
        let mut document = json!({
            "openapi": "3.1.0",
            "info": self.info,
            "paths": paths,
            "components": {
                "schemas": schemas,
                "securitySchemes": self.security_schemes,
            },
        });
        rename_request_refs(&mut document, &names);
        drop_null_from_optional_members(&mut document);
        document
    }
}

/// The final name of every request-side schema: its own name when the
/// response side has none by that name or the same schema, else the name
/// with `Request` appended. Starts by assuming every shared name is the
/// same schema and withdraws that until nothing changes (a schema differs
/// when it refers to one that differs).
fn request_names(
    requests: &Map<String, Value>,
    responses: &Map<String, Value>,
) -> BTreeMap<String, String> {
    let mut names: BTreeMap<String, String> = requests
        .keys()
        .map(|name| (name.clone(), name.clone()))
        .collect();
    loop {
        let mut changed = false;
        for (name, schema) in requests {
            if names[name] != *name {
                continue;
            }
            let mut renamed = schema.clone();
            rename_request_refs(&mut renamed, &names);
            if responses
                .get(name)
                .is_some_and(|response| *response != renamed)
            {
                names.insert(name.clone(), format!("{name}Request"));
                changed = true;
            }
        }
        if !changed {
            return names;
        }
    }
}

/// Points every request-side `$ref` at the schema's final name.
fn rename_request_refs(value: &mut Value, names: &BTreeMap<String, String>) {
    match value {
        Value::Object(object) => {
            for (key, member) in object.iter_mut() {
                if key == "$ref"
                    && let Value::String(reference) = member
                    && let Some(name) = reference.strip_prefix(REQUEST_SCHEMAS)
                {
                    let name = names.get(name).map_or(name, String::as_str);
                    *reference = format!("{SCHEMAS}{name}");
                } else {
                    rename_request_refs(member, names);
                }
            }
        }
        Value::Array(items) => {
            for item in items {
                rename_request_refs(item, names);
            }
        }
        _ => {}
    }
}

/// In every object schema, removes `null` from the schema of each member
/// that is not required (`"type": [T, "null"]` or `anyOf [S, {"type":
/// "null"}]`): such a member is left out when absent, never `null`.
fn drop_null_from_optional_members(value: &mut Value) {
    match value {
        Value::Object(object) => {
            let required: Vec<String> = object
                .get("required")
                .and_then(Value::as_array)
                .map(|names| {
                    names
                        .iter()
                        .filter_map(Value::as_str)
                        .map(str::to_owned)
                        .collect()
                })
                .unwrap_or_default();
            if let Some(Value::Object(properties)) = object.get_mut("properties") {
                for (name, schema) in properties.iter_mut() {
                    if !required.contains(name) {
                        drop_null(schema);
                    }
                }
            }
            for member in object.values_mut() {
                drop_null_from_optional_members(member);
            }
        }
        Value::Array(items) => {
            for item in items {
                drop_null_from_optional_members(item);
            }
        }
        _ => {}
    }
}

fn drop_null(schema: &mut Value) {
    let Value::Object(object) = schema else {
        return;
    };
    if let Some(Value::Array(types)) = object.get_mut("type") {
        types.retain(|kind| kind != "null");
        if types.len() == 1 {
            let only = types.remove(0);
            object.insert("type".into(), only);
        }
    }
    let single = match object.get_mut("anyOf") {
        Some(Value::Array(alternatives)) => {
            alternatives.retain(|alternative| *alternative != json!({"type": "null"}));
            (alternatives.len() == 1).then(|| alternatives.remove(0))
        }
        _ => None,
    };
    if let Some(Value::Object(only)) = single {
        object.remove("anyOf");
        for (key, member) in only {
            object.entry(key).or_insert(member);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(serde::Serialize, serde::Deserialize, JsonSchema)]
    #[serde(rename_all = "camelCase", deny_unknown_fields)]
    #[allow(dead_code)]
    struct Inner {
        units: u64,
        #[serde(default)]
        hold_ms: u64,
    }

    #[derive(serde::Serialize, serde::Deserialize, JsonSchema)]
    #[serde(rename_all = "camelCase", deny_unknown_fields)]
    #[allow(dead_code)]
    struct Outer {
        inner: Inner,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        note: Option<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        inner_too: Option<Inner>,
        same: Same,
    }

    #[derive(serde::Serialize, serde::Deserialize, JsonSchema)]
    #[allow(dead_code)]
    struct Same {
        flag: bool,
    }

    fn document() -> Value {
        let mut document = ApiDocument::new("test", "1", "a test");
        let request = document.request::<Outer>();
        let response = document.response::<Outer>();
        document.operation(
            "POST",
            "/things",
            Operation::new("make", "makes a thing")
                .json_body(request, true)
                .response(200, Response::new("made").json(response)),
        );
        document.finish()
    }

    #[test]
    fn a_type_parsed_and_written_differently_is_named_twice() {
        let document = document();
        let schemas = &document["components"]["schemas"];
        // `holdMs` has a default: optional when parsed, always written.
        assert_eq!(schemas["Inner"]["required"], json!(["units", "holdMs"]));
        assert_eq!(schemas["InnerRequest"]["required"], json!(["units"]));
        // Outer refers to a schema that differs, so it differs too.
        assert_eq!(
            schemas["OuterRequest"]["properties"]["inner"]["$ref"],
            "#/components/schemas/InnerRequest"
        );
        assert_eq!(
            schemas["Outer"]["properties"]["inner"]["$ref"],
            "#/components/schemas/Inner"
        );
        // One schema where both sides agree.
        assert!(schemas.get("SameRequest").is_none());
        assert_eq!(
            schemas["OuterRequest"]["properties"]["same"]["$ref"],
            "#/components/schemas/Same"
        );
        let operation = &document["paths"]["/things"]["post"];
        assert_eq!(
            operation["requestBody"]["content"]["application/json"]["schema"]["$ref"],
            "#/components/schemas/OuterRequest"
        );
        assert_eq!(
            operation["responses"]["200"]["content"]["application/json"]["schema"]["$ref"],
            "#/components/schemas/Outer"
        );
        assert!(!document.to_string().contains("requestSchemas"));
    }

    #[test]
    fn an_optional_member_is_never_null() {
        let document = document();
        let outer = &document["components"]["schemas"]["Outer"]["properties"];
        assert_eq!(outer["note"], json!({"type": "string"}));
        assert_eq!(
            outer["innerToo"],
            json!({"$ref": "#/components/schemas/Inner"})
        );
    }
}
