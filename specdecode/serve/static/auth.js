/* fetch() with the server's API key (`specdecode serve --api-key`): the key is asked for once,
 * when a call gets 401, kept in localStorage and sent as `Authorization: Bearer KEY`. */
(function () {
  "use strict";
  const STORE = "specdecode-api-key";
  let asking = null, declined = false;       // a declined prompt is not repeated (the dashboard polls)

  function withKey(options) {
    const key = localStorage.getItem(STORE);
    const headers = Object.assign({}, (options || {}).headers || {});
    if (key) headers["Authorization"] = "Bearer " + key;
    return Object.assign({}, options || {}, { headers: headers });
  }

  async function askKey() {                     // one prompt at a time, shared by concurrent calls
    if (declined) return false;
    if (!asking) {
      asking = Promise.resolve().then(() => {
        const key = window.prompt("This server needs its API key:");
        if (key) localStorage.setItem(STORE, key.trim());
        else declined = true;
        return Boolean(key);
      }).finally(() => { setTimeout(() => { asking = null; }, 0); });
    }
    return asking;
  }

  async function apiFetch(url, options) {
    let response = await fetch(url, withKey(options));
    if (response.status === 401 && await askKey()) response = await fetch(url, withKey(options));
    return response;
  }

  window.apiFetch = apiFetch;
})();
