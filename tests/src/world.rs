//! A small synchronous world for scenario tests: one central node, a few
//! agents, instant delivery, and a partition switch per agent. Time moves
//! only when a test says so. The simulator adds delays, loss and chance.

use std::collections::BTreeMap;

use agent_core::{
    AgentConfig, CallId, CentralReply, CentralResult, GatewayRequest, GatewayResponse, Now,
};
use shard_format::{AdmissionBudgetV1, BootNonce, Timestamp};

use crate::agent_node::{AgentKey, AgentNode};
use crate::central_node::{CentralNode, Delivery, Observation};
use crate::crypto::{SimSigner, SimVerifier};
use ledger::protocol::Operation;

/// 2026-07-19T14:00:00.000Z, the seed's accounting epoch.
pub const WALL_START_MS: u64 = 1_784_469_600_000;

pub struct World {
    /// Monotonic ms since the world began (all agents share it here).
    pub mono_ms: u64,
    pub central: CentralNode,
    pub agents: Vec<AgentNode>,
    /// Per agent: its central calls fail with `OutcomeUnknown`.
    pub partitioned: Vec<bool>,
    /// Per agent: the next central call is carried out but its reply lost.
    pub lose_next_reply: Vec<bool>,
    /// Per agent: the next shard it is sent arrives with its central
    /// signature broken (tampered in transit).
    pub tamper_next_shard: Vec<bool>,
    pub replies: BTreeMap<(usize, CallId), GatewayResponse>,
    /// Every reply the central ledger sent, for assertions.
    pub central_log: Vec<(usize, agent_core::CentralCall, CentralReply)>,
    next_call: CallId,
    next_nonce: u64,
}

impl std::fmt::Debug for World {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("World")
            .field("mono_ms", &self.mono_ms)
            .field("agents", &self.agents.len())
            .finish_non_exhaustive()
    }
}

impl World {
    /// A central ledger with `policy` published and `agents` enrolled agents,
    /// each configured by `configure`.
    pub fn new(
        agents: usize,
        policy: AdmissionBudgetV1,
        configure: impl Fn(&mut AgentConfig),
    ) -> Self {
        let central_signer = SimSigner::new("central", 0xC0FFEE);
        let mut agent_verifier = SimVerifier::default();
        agent_verifier.trust_sim(&central_signer);
        let keys: Vec<AgentKey> = (0..agents)
            .map(|index| {
                AgentKey::Sim(SimSigner::new(
                    &format!("agent-{index}"),
                    1000 + index as u64,
                ))
            })
            .collect();
        let mut central_verifier = SimVerifier::default();
        for key in &keys {
            if let AgentKey::Sim(signer) = key {
                central_verifier.trust_sim(signer);
            }
        }
        let mut central = CentralNode::new(Box::new(central_signer), Box::new(central_verifier));
        let wall = Timestamp::from_unix_ms(WALL_START_MS).expect("valid");
        central
            .operate(Operation::Publish(Box::new(policy)), wall)
            .expect("commit");
        let now = Now { mono_ms: 0, wall };
        let nodes = keys
            .into_iter()
            .map(|key| {
                central
                    .operate(Operation::Enroll(key.identity().clone()), wall)
                    .expect("commit");
                let mut config = AgentConfig::new(key.identity());
                configure(&mut config);
                AgentNode::start(config, key, agent_verifier.clone(), now)
            })
            .collect::<Vec<_>>();
        let mut world = Self {
            mono_ms: 0,
            central,
            partitioned: vec![false; nodes.len()],
            lose_next_reply: vec![false; nodes.len()],
            tamper_next_shard: vec![false; nodes.len()],
            agents: nodes,
            replies: BTreeMap::new(),
            central_log: Vec::new(),
            next_call: 1,
            next_nonce: 1,
        };
        world.pump();
        world
    }

    pub fn now(&self) -> Now {
        Now {
            mono_ms: self.mono_ms,
            wall: Timestamp::from_unix_ms(WALL_START_MS + self.mono_ms).expect("valid"),
        }
    }

    /// Moves time forward by `ms`: central workers run, agents see the
    /// timeout, everything is pumped.
    pub fn advance(&mut self, ms: u64) {
        self.mono_ms += ms;
        let now = self.now();
        assert!(self.central.run_workers(now.wall), "workers commit");
        for node in &mut self.agents {
            node.core.handle_timeout(now);
        }
        self.pump();
    }

    /// Sends a gateway request to agent `agent` and pumps; returns the call.
    pub fn gateway(&mut self, agent: usize, request: GatewayRequest) -> CallId {
        let call = self.next_call;
        self.next_call += 1;
        let now = self.now();
        self.agents[agent].core.handle_gateway(call, request, now);
        self.pump();
        call
    }

    /// The answer to a gateway call, if it came.
    pub fn response(&self, agent: usize, call: CallId) -> Option<&GatewayResponse> {
        self.replies.get(&(agent, call))
    }

    /// Restarts agent `agent` from its committed journal.
    pub fn restart_agent(&mut self, agent: usize) {
        let now = self.now();
        self.agents[agent].restart(None, now);
        self.pump();
    }

    /// Delivers everything until nothing moves.
    pub fn pump(&mut self) {
        loop {
            let mut moved = false;
            for index in 0..self.agents.len() {
                let now = self.now();
                self.agents[index].commit_journal();
                while let Some((call, response)) = self.agents[index].core.poll_reply() {
                    self.replies.insert((index, call), response);
                    moved = true;
                }
                while let Some(outgoing) = self.agents[index].core.poll_central() {
                    moved = true;
                    let result = if self.partitioned[index] {
                        CentralResult::OutcomeUnknown
                    } else {
                        let nonce = BootNonce(u128::from(self.next_nonce).to_le_bytes());
                        self.next_nonce += 1;
                        let identity = self.agents[index].identity().clone();
                        match self
                            .central
                            .handle(&identity, &outgoing.call, nonce, now.wall)
                        {
                            Delivery::Answered(reply) => {
                                self.central_log.push((
                                    index,
                                    outgoing.call.clone(),
                                    reply.clone(),
                                ));
                                if std::mem::take(&mut self.lose_next_reply[index]) {
                                    CentralResult::OutcomeUnknown
                                } else if let CentralReply::Shard(shard) = &reply
                                    && std::mem::take(&mut self.tamper_next_shard[index])
                                {
                                    let mut shard = shard.clone();
                                    shard.signature.0[0] ^= 1;
                                    CentralResult::Reply(CentralReply::Shard(shard))
                                } else {
                                    CentralResult::Reply(reply)
                                }
                            }
                            Delivery::Crashed => CentralResult::OutcomeUnknown,
                        }
                    };
                    self.agents[index]
                        .core
                        .handle_central(outgoing.request, result, now);
                    self.agents[index].commit_journal();
                }
            }
            if !moved {
                break;
            }
        }
        self.assert_oracles_agree();
    }

    /// The exact oracles (the reference ledger behind the central node, the
    /// reference shard books behind each agent's journal) agree with every
    /// transition so far: a scenario test fails on the first disagreement.
    fn assert_oracles_agree(&mut self) {
        for observation in &self.central.observations {
            if let Observation::ReferenceMismatch(detail) = observation {
                panic!("the central ledger disagrees with the reference model: {detail}");
            }
        }
        for node in &self.agents {
            if let Some(detail) = node.shard_mismatches.first() {
                panic!("a shard book disagrees with its reference: {detail}");
            }
        }
    }
}
