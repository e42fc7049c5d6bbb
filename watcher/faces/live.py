"""status.html's live mode: what `trainq serve` changes in the page it serves at ``GET /``.

The file on disk stays the static page (it reloads itself every 2 s). Served, the meta refresh is
removed and a script follows the server's streams instead: ``/events`` for the watcher's heartbeat,
the counts and job state changes (the page body is fetched again only when a job changed state),
and per running job ``/jobs/ID/metrics`` (progress bar, loss, curve) and ``/jobs/ID/log`` (the last
lines of its output under the card). A ``?token=`` in the page's address is passed on to the streams.
"""

from __future__ import annotations

from trainq.watcher.faces.html import REFRESH_META

#: lines of each running job's log shown under its card
LOG_LINES = 12

_LIVE_CSS = """
#live{position:fixed;top:8px;right:12px;font-size:12px;padding:2px 8px;border-radius:10px;background:#d8f0df}
#live.down{background:#ffe2b3}
pre.live-log{margin:6px 0 0;max-height:14em;overflow:auto;background:#1d2330;color:#e8eaf0;font-size:11px;
padding:6px;border-radius:4px;white-space:pre-wrap;word-break:break-all}
"""

_LIVE_SCRIPT = """
(function(){'use strict';
var LOG_LINES=%(log_lines)d;
var tok=new URLSearchParams(location.search).get('token');
function url(p,q){var s=new URLSearchParams(q||{});if(tok)s.set('token',tok);var t=s.toString();return p+(t?'?'+t:'');}
var hb0=document.getElementById('hb'),state={hb:hb0&&hb0.getAttribute('datetime'),dirty:0,follow:{}},badge=document.createElement('div');badge.id='live';
function setLive(up){badge.textContent=up?'\\u25cf live':'reconnecting\\u2026';badge.className=up?'':'down';}
// the heartbeat's age and the stale banner: status.html's own script judges (faces/html.py, the rules of
// faces/liveness.py: the browser's clock where it agrees with the heartbeat, else watching the value change)
function tick(){if(state.hb&&window.trainqHeartbeat)window.trainqHeartbeat(state.hb);}
function counts(c){if(!c)return;for(var k in c){var b=document.querySelector('.count.'+k+' b');if(b)b.textContent=c[k];}
 if(c.running!==undefined)document.title='trainq \\u00b7 '+c.running+' running';}
function fact(card,name,value){card.querySelectorAll('dt').forEach(function(dt){if(dt.textContent===name)dt.nextSibling.textContent=value;});}
function num(v,d){return typeof v!=='number'?(v===undefined||v===null?'\\u2013':String(v)):Number.isInteger(v)?String(v):String(Number(v.toPrecision(d||4)));}
function point(card,cls,x,y){var svg=card.querySelector('svg.curve'),line=svg&&svg.querySelector('polyline.'+cls);
 if(!line||typeof x!=='number'||typeof y!=='number')return;var p=svg.createSVGPoint();p.x=x;p.y=-y;line.points.appendItem(p);
 var v=svg.viewBox.baseVal;if(x>v.x+v.width)v.width=x-v.x;if(-y<v.y){v.height+=v.y+y;v.y=-y;}if(-y>v.y+v.height)v.height=-y-v.y;}
function show(f){var card=f.card,r=f.rec;if(!card||!card.isConnected)return;
 var bar=card.querySelector('progress'),steps=card.querySelector('.steps');
 if(bar&&typeof r.step==='number'){if(r.total_steps){bar.max=r.total_steps;bar.value=Math.min(r.step,r.total_steps);
  if(steps)steps.textContent=r.step+' / '+r.total_steps+' ('+Math.round(100*Math.min(r.step,r.total_steps)/r.total_steps)+'%%)';}
  else if(steps)steps.textContent='step '+r.step;}
 fact(card,'loss',num(r.loss));fact(card,'eval loss',num(r.eval_loss));fact(card,'epoch',num(r.epoch,3));
 fact(card,'tokens/s',num(r.tokens_per_s));}
function merge(f,r){['step','total_steps','epoch','tokens_per_s','eval_loss'].forEach(function(k){if(r[k]!==undefined&&r[k]!==null)f.rec[k]=r[k];});
 if(r.type!=='eval'&&r.loss!==undefined&&r.loss!==null)f.rec.loss=r.loss;
 if(f.card){if(r.type!=='eval')point(f.card,'loss',r.step,r.loss);point(f.card,'eval_loss',r.step,r.eval_loss);}}
function start(id){var f={id:id,pre:document.createElement('pre'),lines:[],progress:false,rec:{}};f.pre.className='live-log';
 var path='/jobs/'+encodeURIComponent(id);
 function add(text,progress){if(f.progress&&f.lines.length)f.lines.pop();f.lines.push(text);f.progress=progress;
  if(f.lines.length>LOG_LINES)f.lines.shift();f.pre.textContent=f.lines.join('\\n');f.pre.scrollTop=f.pre.scrollHeight;}
 f.log=new EventSource(url(path+'/log',{tail:LOG_LINES}));
 f.log.onmessage=function(e){add(e.data,false);};
 f.log.addEventListener('attempt',function(e){add(e.data,false);});
 f.log.addEventListener('progress',function(e){add(e.data,true);});
 f.log.addEventListener('end',function(){f.log.close();});
 f.metrics=new EventSource(url(path+'/metrics',{from:'end'}));
 f.metrics.onmessage=function(e){merge(f,JSON.parse(e.data));show(f);};
 f.metrics.addEventListener('end',function(){f.metrics.close();});
 return f;}
function stop(f){f.log.close();f.metrics.close();}
function attach(){var seen={};
 document.querySelectorAll('article.job.running').forEach(function(card){var id=card.id.slice(4);seen[id]=true;
  var f=state.follow[id]||(state.follow[id]=start(id));f.card=card;card.appendChild(f.pre);show(f);});
 Object.keys(state.follow).forEach(function(id){if(!seen[id]){stop(state.follow[id]);delete state.follow[id];}});
 document.body.appendChild(badge);tick();}
function reload(){fetch(url('/'),{cache:'no-store'}).then(function(r){return r.ok?r.text():null;}).then(function(t){
 if(!t)return;var doc=new DOMParser().parseFromString(t,'text/html');document.body.replaceWith(document.adoptNode(doc.body));attach();});}
var events=new EventSource(url('/events'));
events.onopen=function(){setLive(true);};events.onerror=function(){setLive(false);};
events.addEventListener('job',function(){state.dirty=2;});
events.addEventListener('watcher',function(e){var d=JSON.parse(e.data);state.hb=(d.watcher||{}).heartbeat_at||state.hb;
 counts(d.counts);tick();if(state.dirty>0){state.dirty--;reload();}});
window.trainqLive=state;setLive(false);attach();setInterval(tick,1000);
})();
"""


def live_page(page: str) -> str:
    """status.html as served: no meta refresh; the live script and its styles added."""
    script = _LIVE_SCRIPT % {"log_lines": LOG_LINES}
    page = page.replace(REFRESH_META, '<meta name="trainq-live" content="1">', 1)
    page = page.replace("</head>", f"<style>{_LIVE_CSS}</style></head>", 1)
    return page.replace("</body>", f"<script>{script}</script></body>", 1)
