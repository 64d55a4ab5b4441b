// spotguard's read-only page. It reads the daemon's own JSON API with the bearer token the
// user types (kept in this tab's sessionStorage, sent only in the Authorization header) and
// shows every value as text: no innerHTML anywhere, so nothing an API answer holds can run.
"use strict";

(function () {
  const PAGE = document.body.dataset.page === "agent" ? "agent" : "controller";
  const KEY = "spotguard-token-" + PAGE;
  const REFRESH_MS = 5000;
  const DETAIL_JOBS = 20; // controller: the most recently changed jobs whose history is read
  const EVENTS_SHOWN = 50;
  let timer = null;
  let busy = false;

  const $ = (id) => document.getElementById(id);

  // --- DOM helpers: text only -------------------------------------------------------------
  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === null || v === undefined) continue;
      if (k.toLowerCase().startsWith("on")) continue; // handlers only by addEventListener
      if (k === "class") node.className = v;
      else node.setAttribute(k, String(v));
    }
    for (const c of children) {
      if (c === null || c === undefined) continue;
      node.append(c instanceof Node ? c : document.createTextNode(String(c)));
    }
    return node;
  }

  function fill(tableId, headers, rows) {
    const table = $(tableId);
    const head = el("tr", {}, ...headers.map((h) => el("th", { scope: "col" }, h)));
    table.tHead.replaceChildren(head);
    table.tBodies[0].replaceChildren(...rows);
    table.hidden = rows.length === 0;
  }

  function cell(content, cls, title) {
    return el("td", { class: cls, title: title }, content);
  }

  function badge(state) {
    const s = String(state || "-");
    return el("span", { class: "state s-" + s.replace(/[^a-z_-]/gi, "") }, s);
  }

  // --- values -----------------------------------------------------------------------------
  function toDate(v) {
    if (v === null || v === undefined || v === "") return null;
    const d = typeof v === "number" ? new Date(v * 1000) : new Date(String(v));
    return isNaN(d.getTime()) ? null : d;
  }

  function age(seconds) {
    const s = Math.max(0, Math.round(seconds));
    if (s < 60) return s + " s";
    if (s < 3600) return Math.floor(s / 60) + " min";
    if (s < 86400) return Math.floor(s / 3600) + " h " + Math.floor((s % 3600) / 60) + " min";
    return Math.floor(s / 86400) + " d " + Math.floor((s % 86400) / 3600) + " h";
  }

  function ago(v) {
    const d = toDate(v);
    return d ? age((Date.now() - d.getTime()) / 1000) + " ago" : "-";
  }

  function iso(v) {
    const d = toDate(v);
    return d ? d.toISOString() : "";
  }

  function inFuture(v) {
    const d = toDate(v);
    if (!d) return "-";
    const s = (d.getTime() - Date.now()) / 1000;
    return s >= 0 ? "in " + age(s) : age(-s) + " ago";
  }

  function bytes(n) {
    if (typeof n !== "number") return "-";
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let v = n, i = 0;
    while (v >= 1024 && i < units.length - 1) { v /= 1024; i++; }
    return (i === 0 ? String(v) : v.toFixed(1)) + " " + units[i];
  }

  // an image id starts with its UTC time: 20261122T132902376960Z-90baf5
  function imageTime(url) {
    const m = /\/images\/(\d{4})(\d{2})(\d{2})T(\d{2})(\d{2})(\d{2})(\d{0,3})\d*Z-/.exec(String(url || ""));
    if (!m) return null;
    return new Date(Date.UTC(+m[1], +m[2] - 1, +m[3], +m[4], +m[5], +m[6], +(m[7] || "0").padEnd(3, "0")));
  }

  function imageCell(url) {
    if (!url) return cell("no image yet", "empty");
    const t = imageTime(url);
    const id = String(url).split("/").pop();
    return el("td", { class: "url", title: String(url) }, id, t ? el("br") : null,
      t ? el("small", { title: t.toISOString() }, age((Date.now() - t.getTime()) / 1000) + " old") : null);
  }

  // --- the API ----------------------------------------------------------------------------
  class Unauthorized extends Error {}

  async function api(path) {
    const token = sessionStorage.getItem(KEY);
    if (!token) throw new Unauthorized("");
    const resp = await fetch(path, {
      headers: { Authorization: "Bearer " + token, Accept: "application/json" },
      cache: "no-store",
      credentials: "omit",
      redirect: "error",
      referrerPolicy: "no-referrer",
    });
    let body = null;
    try { body = await resp.json(); } catch (e) { body = null; }
    // 401: no such token; 403: a token that may not read this (a VM's token on the controller)
    if (resp.status === 401 || resp.status === 403) throw new Unauthorized((body && body.error) || "wrong token");
    if (!resp.ok) throw new Error(path + ": " + resp.status + " " + ((body && body.error) || resp.statusText));
    return body;
  }

  // --- controller -------------------------------------------------------------------------
  function selectedJob() {
    const m = /^#job=(.+)$/.exec(location.hash);
    if (!m) return null;
    try { return decodeURIComponent(m[1]); } catch (e) { return null; }
  }

  function jobButton(name) {
    const b = el("button", { type: "button", class: "link", "data-job": name }, name);
    b.addEventListener("click", () => { location.hash = "job=" + encodeURIComponent(name); });
    return b;
  }

  function where(inst) {
    if (!inst || !inst.instance_id) return "-";
    return [inst.provider, inst.instance_id, inst.zone || inst.region].filter(Boolean).join(" ");
  }

  function change(h) {
    return h.from === h.to ? "(" + (h.to || "-") + ")" : (h.from || "new") + " → " + h.to;
  }

  async function showController() {
    const answer = await api("/v1/jobs");
    const jobs = (answer.jobs || []).slice().sort((a, b) => (b.since || 0) - (a.since || 0));
    const counts = {};
    for (const j of jobs) counts[j.state] = (counts[j.state] || 0) + 1;
    $("summary").replaceChildren(
      el("span", {}, el("b", {}, String(jobs.length)), " job(s)"),
      ...Object.keys(counts).sort().map((s) => el("span", {}, badge(s), " ", String(counts[s]))));
    const chosen = selectedJob();
    fill("jobs", ["job", "state", "for", "reason", "instance", "restarts", "last image"],
      jobs.map((j) => el("tr", { class: j.job === chosen ? "selected" : null, "data-job": j.job },
        el("td", {}, jobButton(j.job)), el("td", {}, badge(j.state)),
        cell(ago(j.since), "when", iso(j.since)), cell(j.reason || "", "reason"),
        cell(where(j.instance)), cell(String(j.restarts ?? 0), "num"), imageCell(j.image_url))));
    const parked = jobs.filter((j) => j.state === "parked");
    fill("parked", ["job", "parked", "image", "reason"],
      parked.map((j) => el("tr", { "data-job": j.job }, el("td", {}, jobButton(j.job)),
        cell(ago(j.since), "when", iso(j.since)), imageCell(j.image_url), cell(j.reason || "", "reason"))));
    $("parked-empty").hidden = parked.length > 0;

    const names = jobs.slice(0, DETAIL_JOBS).map((j) => j.job);
    if (chosen && !names.includes(chosen) && jobs.some((j) => j.job === chosen)) names.push(chosen);
    const views = await Promise.all(names.map((n) =>
      api("/v1/jobs/" + encodeURIComponent(n)).catch((e) => { if (e instanceof Unauthorized) throw e; return null; })));
    const events = [];
    let timeline = null;
    for (const v of views) {
      if (!v) continue;
      for (const h of v.history || []) events.push({ job: v.name, ...h });
      if (v.name === chosen) timeline = v;
    }
    events.sort((a, b) => (b.at || 0) - (a.at || 0));
    const recent = events.slice(0, EVENTS_SHOWN);
    fill("events", ["when", "job", "change", "reason"],
      recent.map((e) => el("tr", {}, cell(ago(e.at), "when", iso(e.at)), el("td", {}, jobButton(e.job)),
        cell(change(e)), cell(e.reason || "", "reason"))));
    $("events-empty").hidden = recent.length > 0;
    $("timeline-section").hidden = timeline === null;
    if (timeline) {
      $("timeline-title").textContent = "Timeline of " + timeline.name;
      fill("timeline", ["at", "change", "reason"],
        (timeline.history || []).map((h) => el("tr", {}, cell(iso(h.at), "when"), cell(change(h)), cell(h.reason || "", "reason"))));
    }
    for (const id of ["summary", "jobs-section", "parked-section", "events-section"]) $(id).hidden = false;
  }

  // --- agent ------------------------------------------------------------------------------
  async function showAgent() {
    const [s, recent] = await Promise.all([api("/status"), api("/events")]);
    const a = s.agent || {};
    const kept = Array.isArray(a.kept_images) ? a.kept_images.length : 0;
    $("summary").replaceChildren(
      el("span", {}, "agent pid ", el("b", {}, String(a.pid ?? "-"))),
      el("span", {}, "cloud ", el("b", {}, a.cloud || "none")),
      el("span", {}, "store ", el("b", {}, a.store || "-")),
      el("span", {}, "controller ", el("b", {}, a.controller || "-")),
      el("span", {}, "reports pending ", el("b", {}, String(a.reports_pending ?? 0))),
      el("span", {}, "kept images ", el("b", {}, String(kept))),
      el("span", { title: iso(a.started) }, "up ", el("b", {}, ago(a.started).replace(" ago", ""))));
    const parked = s.parked || [];
    const parkedNames = new Set(parked.map((p) => p.job));
    const jobs = (s.jobs || []).filter((j) => !(parkedNames.has(j.job) && j.state === "parked"));
    fill("jobs", ["job", "pid", "state", "activity", "last image", "checkpoints", "failures", "next periodic", "pending"],
      jobs.map((j) => {
        const last = j.last_image || null;
        const img = last
          ? el("td", { class: "url", title: String(last.url || "") }, String(last.url || "").split("/").pop(),
            el("br"), el("small", { title: iso(last.frozen_at) }, ago(last.frozen_at).replace(" ago", " old")))
          : cell("no image yet (this agent)", "empty");
        const pending = (j.pending || []).map((p) => p.action + " " + inFuture(p.start_at) + " (" + p.reason + ")");
        return el("tr", { "data-job": j.job }, cell(j.job), cell(String(j.pid ?? "-"), "num"), el("td", {}, badge(j.state)),
          cell(j.activity || "-"), img, cell(String(j.checkpoints ?? 0), "num"), cell(String(j.failures ?? 0), "num"),
          cell(j.next_periodic ? inFuture(j.next_periodic) : "-", null, iso(j.next_periodic)),
          cell(pending.length ? pending.join("; ") : "-", "reason"));
      }));
    fill("parked", ["job", "place", "where", "parked", "size", "wake on connect", "reason"],
      parked.map((p) => el("tr", { "data-job": p.job }, cell(p.job), el("td", {}, badge("parked"), " ", String(p.place || "")),
        cell(p.where || "-", "url"), cell(ago(p.since), "when", iso(p.since)), cell(bytes(p.bytes), "num"),
        cell(p.wake_on_connect ? "yes" : "no"), cell(p.reason || "", "reason"))));
    $("parked-empty").hidden = parked.length > 0;
    // notices, checkpoints, parks and unparks, newest first (the agent's GET /events)
    const events = (recent.events || []).slice(0, EVENTS_SHOWN);
    fill("events", ["when", "job", "event", "what"],
      events.map((e) => el("tr", { "data-kind": e.kind }, cell(ago(e.at), "when", iso(e.at)),
        cell(e.job || "-"), el("td", {}, badge(e.kind)), cell(e.text || "", "reason"))));
    $("events-empty").hidden = events.length > 0;
    const sources = Object.entries(s.sources || {});
    fill("sources", ["source", "health"],
      sources.map(([name, h]) => el("tr", {}, cell(name),
        cell(Object.entries(h || {}).map(([k, v]) => k + ": " + (v === null ? "-" : String(v))).join(", "), "reason"))));
    $("sources-section").hidden = sources.length === 0;
    for (const id of ["summary", "jobs-section", "parked-section", "events-section"]) $(id).hidden = false;
  }

  // --- the loop ---------------------------------------------------------------------------
  function setStatus(text, error) {
    const s = $("status");
    s.textContent = text;
    s.className = error ? "error" : "";
  }

  function showLogin(why) {
    clearTimeout(timer);
    for (const id of ["summary", "jobs-section", "parked-section", "events-section", "timeline-section", "sources-section"]) $(id).hidden = true;
    $("forget").hidden = true;
    $("login").hidden = false;
    setStatus(why ? "token refused: " + why : "token needed", Boolean(why));
    $("token").focus();
  }

  async function refresh() {
    if (busy) return;
    busy = true;
    clearTimeout(timer);
    try {
      await (PAGE === "agent" ? showAgent() : showController());
      $("login").hidden = true;
      $("forget").hidden = false;
      setStatus("updated " + new Date().toLocaleTimeString() + " · every " + REFRESH_MS / 1000 + " s", false);
      timer = setTimeout(refresh, REFRESH_MS);
    } catch (e) {
      if (e instanceof Unauthorized) {
        sessionStorage.removeItem(KEY);
        showLogin(e.message);
      } else {
        setStatus("cannot read the API: " + (e && e.message ? e.message : String(e)), true);
        timer = setTimeout(refresh, REFRESH_MS);
      }
    } finally {
      busy = false;
    }
  }

  function start() {
    $("login").addEventListener("submit", (ev) => {
      ev.preventDefault();
      const value = $("token").value.trim();
      $("token").value = "";
      if (!value) return;
      sessionStorage.setItem(KEY, value);
      refresh();
    });
    $("forget").addEventListener("click", () => {
      sessionStorage.removeItem(KEY);
      showLogin("");
    });
    window.addEventListener("hashchange", refresh);
    if (sessionStorage.getItem(KEY)) refresh();
    else showLogin("");
  }

  start();
})();
