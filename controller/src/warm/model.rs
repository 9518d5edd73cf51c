//! A warm pool as the API carries it, checked: every refusal is
//! INVALID_ARGUMENT naming the field in the API's JSON spelling
//! (`capacity.bufferMin`), so the lifecycle's `/pools` can pass it on.

use sandbolt_proto::agent::v1 as apb;
use sandbolt_proto::control::v1 as pb;
use sandbolt_proto::quantity;

use crate::clock;
use crate::error::{Error, Result};
use crate::limits::KNOWN_RUNTIMES;
use crate::placement::or_default;
use crate::store::{Resources, WarmPoolRecord};

fn invalid(msg: String) -> Error {
    Error::InvalidArgument(msg)
}

/// A new pool from a create request: checked, normalized, generation 1.
/// `policy` is the agent pool's (its maxima bound the template's limits).
pub fn new_pool(p: &pb::WarmPool, policy: Option<&apb::PoolPolicy>) -> Result<WarmPoolRecord> {
    crate::volume::check_name("name", &p.name)?;
    let agent_pool = or_default(p.agent_pool.trim()).to_string();
    check_agent_pool(&agent_pool)?;
    let t = p
        .template
        .as_ref()
        .ok_or_else(|| invalid("template is required".into()))?;
    let image = template_image(&t.image)?;
    let runtime = t.runtime.trim().to_string();
    if !runtime.is_empty() && !KNOWN_RUNTIMES.contains(&runtime.as_str()) {
        return Err(invalid(format!(
            "template.runtime {runtime:?} is unknown (known: {})",
            KNOWN_RUNTIMES.join(", ")
        )));
    }
    let limits = template_limits(t.limits.as_ref(), &agent_pool, policy)?;
    for k in t.env.keys() {
        if k.is_empty() || k.contains('=') || k.contains('\0') {
            return Err(invalid(format!(
                "template.env: {k:?} is not an environment variable name"
            )));
        }
    }
    let cap = p.capacity.unwrap_or_default();
    check_capacity(&cap)?;
    Ok(WarmPoolRecord {
        name: p.name.clone(),
        agent_pool,
        image,
        runtime,
        limits,
        env: t.env.clone().into_iter().collect(),
        buffer_min: cap.buffer_min,
        buffer_max: cap.buffer_max,
        pool_min: cap.pool_min,
        pool_max: cap.pool_max,
        created_at_unix_ms: clock::now_unix_ms(),
        generation: 1,
        revision: String::new(),
    })
}

/// Agent pool names follow the agent's `--pool` (any non-empty word
/// without separators).
fn check_agent_pool(s: &str) -> Result<()> {
    if s.len() > 253
        || !s
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '.' | '_'))
    {
        return Err(invalid(format!(
            "agentPool {s:?} is not a pool name (letters, digits, '-', '.', '_')"
        )));
    }
    Ok(())
}

/// The template's image, normalized (`busybox` → `docker.io/library/busybox:latest`).
fn template_image(image: &str) -> Result<String> {
    let image = image.trim();
    if image.is_empty() {
        return Err(invalid("template.image is required".into()));
    }
    sandbolt_image_ref::ImageRef::parse(image)
        .map_err(|e| invalid(format!("template.image {image:?}: {e}")))?;
    Ok(sandbolt_image_ref::normalize(image))
}

/// The template's limits: each parses and is within the agent pool's
/// maximum (when its agents reported one).
fn template_limits(
    l: Option<&pb::ResourceList>,
    agent_pool: &str,
    policy: Option<&apb::PoolPolicy>,
) -> Result<Resources> {
    let Some(l) = l else {
        return Ok(Resources::default());
    };
    if !l.ephemeral_storage.is_empty() {
        return Err(invalid(
            "template.limits.ephemeralStorage is not supported on a warm pool's template (a warm sandbox is measured only once claimed); set resources.limits.ephemeral_storage on the create instead".into(),
        ));
    }
    let max = policy
        .and_then(|p| p.max_limits.clone())
        .unwrap_or_default();
    let over = |field: &str, v: &str, m: &str| {
        invalid(format!(
            "{field} {v} is above agent pool {agent_pool:?}'s maximum {m}"
        ))
    };
    let cpu = l.cpu.trim();
    if !cpu.is_empty() {
        let asked =
            quantity::millicores(cpu).map_err(|e| invalid(format!("template.limits.cpu: {e}")))?;
        if quantity::millicores(&max.cpu).is_ok_and(|m| asked > m) {
            return Err(over("template.limits.cpu", cpu, &max.cpu));
        }
    }
    let memory = l.memory.trim();
    if !memory.is_empty() {
        let asked =
            quantity::bytes(memory).map_err(|e| invalid(format!("template.limits.memory: {e}")))?;
        if quantity::bytes(&max.memory).is_ok_and(|m| asked > m) {
            return Err(over("template.limits.memory", memory, &max.memory));
        }
    }
    if l.pids < 0 {
        return Err(invalid(format!(
            "template.limits.pids {} must not be negative",
            l.pids
        )));
    }
    if max.pids_limit > 0 && l.pids > max.pids_limit {
        return Err(over(
            "template.limits.pids",
            &l.pids.to_string(),
            &max.pids_limit.to_string(),
        ));
    }
    Ok(Resources {
        cpu_limit: cpu.to_string(),
        memory_limit: memory.to_string(),
        pids_limit: l.pids,
        ..Default::default()
    })
}

/// OpenSandbox's capacitySpec rules, each violation naming its field.
pub fn check_capacity(c: &pb::WarmCapacity) -> Result<()> {
    for (field, v) in [
        ("capacity.bufferMin", c.buffer_min),
        ("capacity.bufferMax", c.buffer_max),
        ("capacity.poolMin", c.pool_min),
        ("capacity.poolMax", c.pool_max),
    ] {
        if v < 0 {
            return Err(invalid(format!("{field} {v} must not be negative")));
        }
    }
    if c.buffer_min > c.buffer_max {
        return Err(invalid(format!(
            "capacity.bufferMin {} is above capacity.bufferMax {}",
            c.buffer_min, c.buffer_max
        )));
    }
    if c.pool_min > c.pool_max {
        return Err(invalid(format!(
            "capacity.poolMin {} is above capacity.poolMax {}",
            c.pool_min, c.pool_max
        )));
    }
    if c.buffer_max > c.pool_max {
        return Err(invalid(format!(
            "capacity.bufferMax {} is above capacity.poolMax {}",
            c.buffer_max, c.pool_max
        )));
    }
    Ok(())
}

/// The capacity of `p` as the API carries it.
pub fn capacity_of(p: &WarmPoolRecord) -> pb::WarmCapacity {
    pb::WarmCapacity {
        buffer_min: p.buffer_min,
        buffer_max: p.buffer_max,
        pool_min: p.pool_min,
        pool_max: p.pool_max,
    }
}

/// `p` in the control API's shape, with `status`.
pub fn pool_out(p: &WarmPoolRecord, status: pb::WarmPoolStatus) -> pb::WarmPool {
    let l = &p.limits;
    let limits =
        (!l.cpu_limit.is_empty() || !l.memory_limit.is_empty() || l.pids_limit != 0).then(|| {
            pb::ResourceList {
                cpu: l.cpu_limit.clone(),
                memory: l.memory_limit.clone(),
                pids: l.pids_limit,
                ephemeral_storage: String::new(),
            }
        });
    pb::WarmPool {
        name: p.name.clone(),
        agent_pool: p.agent_pool.clone(),
        template: Some(pb::WarmTemplate {
            image: p.image.clone(),
            runtime: p.runtime.clone(),
            limits,
            env: p.env.clone().into_iter().collect(),
        }),
        capacity: Some(capacity_of(p)),
        status: Some(status),
        created_at_unix_ms: p.created_at_unix_ms,
    }
}

/// What makes `p`'s warm sandboxes interchangeable (sent to agents).
pub fn class_of(p: &WarmPoolRecord) -> apb::WarmClass {
    apb::WarmClass {
        warm_pool: p.name.clone(),
        image: p.image.clone(),
        runtime: p.runtime.clone(),
        resources: Some(apb::Resources {
            cpu: p.limits.cpu_limit.clone(),
            memory: p.limits.memory_limit.clone(),
            pids_limit: p.limits.pids_limit,
            ..Default::default()
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(f: impl FnOnce(&mut pb::WarmPool)) -> pb::WarmPool {
        let mut p = pb::WarmPool {
            name: "py".into(),
            template: Some(pb::WarmTemplate {
                image: "busybox".into(),
                ..Default::default()
            }),
            capacity: Some(pb::WarmCapacity {
                buffer_min: 1,
                buffer_max: 2,
                pool_min: 0,
                pool_max: 5,
            }),
            ..Default::default()
        };
        f(&mut p);
        p
    }

    fn refused(p: pb::WarmPool, policy: Option<&apb::PoolPolicy>) -> String {
        match new_pool(&p, policy) {
            Err(Error::InvalidArgument(m)) => m,
            other => panic!("expected INVALID_ARGUMENT, got {other:?}"),
        }
    }

    #[test]
    fn a_valid_pool_is_normalized() {
        let r = new_pool(&pool(|_| {}), None).unwrap();
        assert_eq!(r.image, "docker.io/library/busybox:latest");
        assert_eq!(r.agent_pool, "default");
        assert_eq!((r.buffer_min, r.buffer_max, r.pool_max), (1, 2, 5));
        assert_eq!(r.generation, 1);
        assert!(r.revision.is_empty());
    }

    #[test]
    fn every_violation_names_its_field() {
        let cap = |b0, b1, p0, p1| {
            pool(move |p| {
                p.capacity = Some(pb::WarmCapacity {
                    buffer_min: b0,
                    buffer_max: b1,
                    pool_min: p0,
                    pool_max: p1,
                })
            })
        };
        let cases = [
            (pool(|p| p.name = "Bad_Name".into()), "name "),
            (pool(|p| p.name.clear()), "name is required"),
            (pool(|p| p.template = None), "template is required"),
            (
                pool(|p| p.template.as_mut().unwrap().image.clear()),
                "template.image is required",
            ),
            (
                pool(|p| p.template.as_mut().unwrap().image = "UPPER::bad".into()),
                "template.image ",
            ),
            (
                pool(|p| p.template.as_mut().unwrap().runtime = "kata".into()),
                "template.runtime ",
            ),
            (
                pool(|p| {
                    p.template.as_mut().unwrap().limits = Some(pb::ResourceList {
                        cpu: "lots".into(),
                        ..Default::default()
                    })
                }),
                "template.limits.cpu",
            ),
            (
                pool(|p| {
                    p.template.as_mut().unwrap().limits = Some(pb::ResourceList {
                        memory: "-1Mi".into(),
                        ..Default::default()
                    })
                }),
                "template.limits.memory",
            ),
            (cap(-1, 2, 0, 5), "capacity.bufferMin -1"),
            (cap(0, 2, 0, -5), "capacity.poolMax -5"),
            (cap(3, 2, 0, 5), "capacity.bufferMin 3 is above"),
            (cap(0, 2, 6, 5), "capacity.poolMin 6 is above"),
            (
                cap(0, 6, 0, 5),
                "capacity.bufferMax 6 is above capacity.poolMax",
            ),
        ];
        for (p, want) in cases {
            let m = refused(p, None);
            assert!(m.starts_with(want), "{m:?} should start with {want:?}");
        }
    }

    #[test]
    fn template_limits_stay_within_the_agent_pools_maximum() {
        let policy = apb::PoolPolicy {
            max_limits: Some(apb::Resources {
                cpu: "1".into(),
                memory: "256Mi".into(),
                pids_limit: 100,
                ..Default::default()
            }),
            ..Default::default()
        };
        let with = |cpu: &str, memory: &str, pids| {
            let (cpu, memory) = (cpu.to_string(), memory.to_string());
            pool(move |p| {
                p.template.as_mut().unwrap().limits = Some(pb::ResourceList {
                    cpu,
                    memory,
                    pids,
                    ..Default::default()
                })
            })
        };
        let ok = new_pool(&with("500m", "128Mi", 50), Some(&policy)).unwrap();
        assert_eq!(ok.limits.cpu_limit, "500m");
        assert!(
            refused(with("2", "", 0), Some(&policy)).starts_with("template.limits.cpu 2 is above")
        );
        assert!(
            refused(with("", "1Gi", 0), Some(&policy))
                .starts_with("template.limits.memory 1Gi is above")
        );
        assert!(refused(with("", "", 101), Some(&policy)).starts_with("template.limits.pids 101"));
    }
}
